"""Per-rank checkpoints, written atomically: RUN_DIR/checkpoints/step_<N>/rank<r>.pt, then ``latest``.

Each rank writes its own file (temp file + rename); after a barrier, rank 0 writes ``latest`` (atomic), so a
``latest`` always names a complete step. The file holds the model and optimizer state, the step (the data
position: batches are a function of the step) and every RNG state, so a resumed run repeats the loss curve.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

from piper_plan.errors import PiperError
from piper_plan.fileio import atomic_write_text


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rank_path(run_dir: Path, step: int, rank: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step}" / f"rank{rank}.pt"


def save_rank(run_dir: Path, step: int, rank: int, model, optimizer) -> Path:
    """Atomically write this rank's state for ``step`` (the number of completed steps)."""
    path = rank_path(run_dir, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng_state()}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def mark_latest(run_dir: Path, step: int) -> None:
    """Rank 0, after every rank saved: point ``latest`` at ``step``."""
    atomic_write_text(Path(run_dir) / "checkpoints" / "latest", f"{step}\n")


def latest_step(run_dir: Path) -> int | None:
    path = Path(run_dir) / "checkpoints" / "latest"
    return int(path.read_text().strip()) if path.is_file() else None


def load_rank(run_dir: Path, step: int, rank: int, model, optimizer) -> int:
    """Restore model, optimizer and RNG; return the step to continue from."""
    path = rank_path(run_dir, step, rank)
    if not path.is_file():
        raise PiperError(f"checkpoint for rank {rank} missing (world size changed?)", path=str(path))
    state = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    return int(state["step"])
