"""Training tokens: synthetic (seeded, deterministic, learnable) or a memory-mapped .bin of uint16/uint32.

A batch is a pure function of (seed, step): every rank builds the same global batch [global_batch, seq_len + 1]
and takes its dp slice, so resuming at step s needs nothing but s (the data position is the step). A model with
D multi-token-prediction modules trains on ``extra`` = D more tokens per sequence (module k's targets lie k + 1
further on: runtime/pipeline.py MTPLoss); the first seq_len + 1 tokens are the same with or without them.
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

    def __init__(self, vocab_size: int, seq_len: int, seed: int, extra: int = 0) -> None:
        self.vocab_size, self.seq_len, self.seed, self.extra = vocab_size, seq_len, seed, extra

    def batch(self, step: int, num_sequences: int) -> torch.Tensor:
        """[num_sequences, seq_len + 1 + extra]; the extra tokens continue each sequence, their noise drawn after
        the first seq_len + 1 tokens' (which are therefore the same for any ``extra``)."""
        rng = np.random.default_rng([self.seed, step])
        tokens = np.empty((num_sequences, self.seq_len + 1 + self.extra), dtype=np.int64)
        tokens[:, 0] = rng.integers(0, self.vocab_size, num_sequences)
        for t in range(1, tokens.shape[1]):
            tokens[:, t] = (5 * tokens[:, t - 1] + 7) % self.vocab_size
        for part in (tokens[:, : self.seq_len + 1], tokens[:, self.seq_len + 1:]):   # views
            noise = rng.random(part.shape) < 0.1
            part[noise] = rng.integers(0, self.vocab_size, int(noise.sum()))
        return torch.from_numpy(tokens)


class MemmapTokens:
    """A flat token file; sequence i of step s starts at ((s x n + i) x seq_len) mod (length - seq_len - 1)."""

    def __init__(self, path: str | Path, vocab_size: int, seq_len: int, extra: int = 0) -> None:
        self.path, self.vocab_size, self.seq_len, self.extra = Path(path), vocab_size, seq_len, extra
        self.tokens = open_token_file(self.path, vocab_size, seq_len, extra)

    def batch(self, step: int, num_sequences: int) -> torch.Tensor:
        """[num_sequences, seq_len + 1 + extra] (``extra`` tokens more per sequence, the starts unchanged)."""
        length = self.seq_len + 1 + self.extra
        span = len(self.tokens) - length
        starts = ((step * num_sequences + np.arange(num_sequences)) * self.seq_len) % max(span, 1)
        batch = np.stack([np.asarray(self.tokens[s: s + length], dtype=np.int64) for s in starts])
        if batch.max() >= self.vocab_size:   # every rank reads the whole batch: the same answer on every rank
            row, col = np.unravel_index(int(batch.argmax()), batch.shape)
            raise PiperError(f"token {int(batch.max())} at token index {int(starts[row]) + int(col)} is not allowed; "
                             f"allowed: 0 to vocab_size - 1 = {self.vocab_size - 1} (step {step + 1})",
                             path=str(self.path), field="runtime.data")
        return torch.from_numpy(batch)


def open_token_file(path: Path, vocab_size: int, seq_len: int, extra: int = 0) -> np.memmap:
    """Open and check a token file (sequences of seq_len + 1 + ``extra`` tokens); every problem is one PiperError
    naming the file."""
    from piper_plan.fileio import check_regular_file

    dtype = token_dtype(vocab_size)
    check_regular_file(path, field="runtime.data")          # np.memmap of a FIFO would block for ever
    try:
        tokens = np.memmap(path, dtype=dtype, mode="r")
    except (OSError, ValueError) as exc:
        raise PiperError(f"cannot read token file ({exc.__class__.__name__}: {exc}); expected a flat "
                         f"{np.dtype(dtype).name} .bin", path=str(path), field="runtime.data") from None
    if len(tokens) < seq_len + 1 + extra:
        need = f"seq_len + 1 = {seq_len + 1}" if not extra else f"seq_len + 1 + mtp_layers = {seq_len + 1 + extra}"
        raise PiperError(f"holds {len(tokens)} tokens, fewer than {need}", path=str(path), field="runtime.data")
    return tokens


def make_source(data: str | None, vocab_size: int, seq_len: int, seed: int, extra: int = 0):
    """The token source; ``extra`` tokens more per sequence (MTP modules' targets)."""
    if data is None:
        return SyntheticTokens(vocab_size, seq_len, seed, extra)
    return MemmapTokens(data, vocab_size, seq_len, extra)


def dp_slice(batch_NS: torch.Tensor, dp_index: int, dp: int, extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This dp rank's sequences, as (inputs [n, S], targets [n, S + extra]) of a batch [N, S + 1 + extra]."""
    n = batch_NS.shape[0] // dp
    mine = batch_NS[dp_index * n: (dp_index + 1) * n]
    return mine[:, : mine.shape[1] - 1 - extra].contiguous(), mine[:, 1:].contiguous()
