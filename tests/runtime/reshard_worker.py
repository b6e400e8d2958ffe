"""Code that runs inside spawned gloo ranks for tests/runtime/test_reshard.py: train on layout A with a checkpoint,
resume on layout B, and bad checkpoints (one spawn per world size runs every job in order)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist

LR = 1e-2


def _trainer(plan: dict, rank: int, world: int):
    from piper_plan.planfile import parse_plan_dict
    from piper_plan.runtime.train import Trainer

    # no balance loss: it is computed per micro-batch, so layouts with other micro-batch counts would differ
    return Trainer(parse_plan_dict(plan, "test plan"), rank, world, torch.device("cpu"), lr=LR, aux_loss_coeff=0.0)


def train(plan: dict, rank: int, world: int, run_dir: str, steps: int = 4, save_at: int = 2) -> dict:
    """Layout A: ``steps`` steps straight, saving after step ``save_at``; the losses (None off the last stage)
    and the slot maps and torch RNG state at the checkpoint."""
    trainer = _trainer(plan, rank, world)
    losses, slots, rng = [], None, None
    for step in range(steps):
        losses.append(trainer.train_step(step).report()["loss"])
        if step + 1 == save_at:
            trainer.save(Path(run_dir), save_at)
            slots = {i: m.slot_of_expert.tolist() for i, m in trainer.module.moe_layers().items()}
            rng = torch.get_rng_state()
    return {"losses": losses, "slots": slots, "rng": rng}


def resume(plan: dict, rank: int, world: int, run_dir: str, steps: int = 4) -> dict:
    """Layout B: a fresh trainer resuming from ``run_dir`` up to ``steps``; its losses, and its slot maps and
    torch RNG state right after the resume."""
    torch.manual_seed(1234 + rank)  # disturb the RNG: resume must set it
    trainer = _trainer(plan, rank, world)
    start, _ = trainer.resume(Path(run_dir))
    slots = {i: m.slot_of_expert.tolist() for i, m in trainer.module.moe_layers().items()}
    rng = torch.get_rng_state()
    losses = [trainer.train_step(step).report()["loss"] for step in range(start, steps)]
    return {"start": start, "losses": losses, "slots": slots, "rng": rng}


def bad_copies(rank: int, world: int, run_dir: str) -> None:
    """Rank 0: copies of ``run_dir``'s checkpoint with rank 1's shard deleted, and with it cut short."""
    if rank == 0:
        for name in ("missing_shard", "short_shard", "failed_save"):
            shutil.copytree(run_dir, f"{run_dir}_{name}")
        (Path(f"{run_dir}_missing_shard") / "checkpoints" / "step_2" / "__1_0.distcp").unlink()
        short = Path(f"{run_dir}_short_shard") / "checkpoints" / "step_2" / "__1_0.distcp"
        short.write_bytes(short.read_bytes()[:100])
    dist.barrier()


def failed_save(plan: dict, rank: int, world: int, run_dir: str) -> dict:
    """Resume from step 2, train to 4, and save with rank 1's write failing (an object its torch.save cannot
    pickle): the save must fail on every rank and leave step 2 usable; then a fresh trainer resumes from it."""
    import piper_plan.runtime.checkpoint as ck

    trainer = _trainer(plan, rank, world)
    for step in range(trainer.resume(Path(run_dir))[0], 4):
        trainer.train_step(step)
    real = ck._rng_bytes
    if rank == 1:
        ck._rng_bytes = lambda: (lambda: None)
    try:
        trainer.save(Path(run_dir), 4)
        raised = None
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        raised = type(exc).__name__
    finally:
        ck._rng_bytes = real
    dist.barrier()
    root = Path(run_dir) / "checkpoints"
    names, latest = sorted(p.name for p in root.iterdir()), (root / "latest").read_text().strip()
    return {"raised": raised, "names": names, "latest": latest, "again": resume(plan, rank, world, run_dir)}


def bad_resume(plan: dict, rank: int, world: int, run_dir: str) -> dict:
    """A resume that must fail: the PiperError message on this rank, and the checkpoint directory's files."""
    from piper_plan.errors import PiperError

    before = _files(Path(run_dir))
    try:
        _trainer(plan, rank, world).resume(Path(run_dir))
        message = None
    except PiperError as exc:
        message = str(exc)
    dist.barrier()  # every rank came back: nothing hangs
    return {"message": message, "unchanged": _files(Path(run_dir)) == before}


def dcp_error(rank: int, world: int, run_dir: str) -> dict:
    """dcp.load where only the last rank asks for a key the checkpoint lacks (bypassing the pre-check): the
    failure must reach every rank as the same PiperError, not hang the others."""
    from piper_plan.errors import PiperError
    from piper_plan.runtime.checkpoint import _dcp_load, step_dir

    flat = {"model.embed.weight": torch.empty(512, 64)} if rank == 0 else {}
    if rank == world - 1:
        flat["model.no_such_weight"] = torch.empty(3)
    try:
        _dcp_load(flat, step_dir(Path(run_dir), 2))
        return {"message": None}
    except PiperError as exc:
        return {"message": str(exc)}


def _files(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def worker(rank: int, world: int, port: int, jobs: list, out_dir: str) -> None:
    from workers import finish, init

    init(rank, world, port)
    kinds = {"train": train, "resume": resume, "bad_copies": bad_copies, "bad_resume": bad_resume,
             "dcp_error": dcp_error, "failed_save": failed_save}
    results = {name: kinds[kind](rank=rank, world=world, **kwargs) for name, kind, kwargs in jobs}
    finish(results, rank, out_dir)
