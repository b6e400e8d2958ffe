"""Code that runs inside spawned gloo ranks (one spawn runs several checks: each torch import costs seconds)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def init(rank: int, world: int, port: int) -> None:
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable(all_threads=True)  # a rank that dies of a signal (SIGABRT, SIGSEGV) prints where it was

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def train_and_record(plan: dict, rank: int, world: int, steps: int, aux: float) -> dict:
    """Run ``steps`` steps; per step the loss (last stage) and every gradient after the dp/edp sync."""
    from piper_plan.planfile import parse_plan_dict
    from piper_plan.runtime.train import Trainer

    trainer = Trainer(parse_plan_dict(plan, "test plan"), rank, world, torch.device("cpu"), lr=1e-2, aux_loss_coeff=aux)
    out = {"losses": [], "mtp_losses": [], "grads": [], "first_expert": {}, "grad_norms": [],
           "init": full_params(trainer.module)}
    for step in range(steps):
        report = trainer.train_step(step).report()
        out["losses"].append(report["loss"])
        out["mtp_losses"].append(report["mtp_loss"])
        out["grad_norms"].append(float(trainer.grad_norm))
        out["grads"].append({n: _full(q.grad) for n, q in trainer.module.named_parameters()})
    out["first_expert"] = {i: m.first_expert for i, m in trainer.module.moe_layers().items()}
    out["expert_tokens"] = report["expert_tokens"]
    out["memory"] = report["memory"]
    return out


def full_params(module) -> dict:
    """Every parameter before training as one whole tensor (a DTensor gathered: collective over its mesh)."""
    return {n: _full(q.detach()).clone() for n, q in module.named_parameters()}


def _full(grad):
    """A gradient as one whole tensor (a tp-split DTensor gathered: collective over its tp group)."""
    full = getattr(grad, "full_tensor", None)
    return full() if full is not None else grad.clone()


def overlap_check(plan: dict, rank: int, world: int, bucket_bytes: int) -> dict:
    """One step's gradients after sync_grads with the dp / edp all-reduces overlapped with backward (small buckets)
    and with them all blocking after backward (the hooks removed: every bucket reduced in finish, the old path);
    the overlapped run's launches (runtime/grad_sync.py)."""
    from piper_plan.planfile import parse_plan_dict
    from piper_plan.runtime.train import Trainer

    cfg = parse_plan_dict(plan, "test plan")
    out = {}
    for name in ("overlapped", "blocking"):
        trainer = Trainer(cfg, rank, world, torch.device("cpu"), lr=1e-2, aux_loss_coeff=0.01)
        trainer.reducer.remove()
        if name == "overlapped":
            trainer.reducer = trainer._reducer(bucket_bytes)
        trainer.reducer.arm()
        trainer.forward_backward(0)
        launches = list(trainer.reducer.launches)
        trainer.sync_grads()
        out[name] = {"grads": {n: _full(q.grad) for n, q in trainer.module.named_parameters()},
                     "launches": launches, "hooked": trainer.reducer.hooked_params,
                     "buckets": trainer.reducer.overlapped_buckets}
    return out


def dispatch_checks(rank: int, world: int) -> dict:
    """dispatch -> combine returns the input; a layout where ranks receive nothing does not hang."""
    import torch.distributed as dist

    from piper_plan.runtime.dispatch import FlatDispatcher

    disp = FlatDispatcher(dist.new_group(list(range(world))))
    gen = torch.Generator().manual_seed(rank)
    counts = torch.randint(0, 5, (world,), generator=gen)
    x = torch.randn(int(counts.sum()), 3, generator=gen, requires_grad=True)
    layout = disp.layout(counts)
    back = disp.combine(disp.dispatch(x, layout), layout)
    back.sum().backward()
    only_to_0 = torch.tensor([4 if d == 0 else 0 for d in range(world)])
    lay0 = disp.layout(only_to_0)
    got = disp.dispatch(torch.full((4, 2), float(rank)), lay0)
    return {"identity_err": float((back - x).abs().max().detach()), "grad_ones": bool(torch.all(x.grad == 1)),
            "send": layout.send_counts, "recv": layout.recv_counts, "zero_recv_rows": got.shape[0],
            "zero_recv_values": got[:, 0].tolist()}


def resume_check(plan: dict, rank: int, world: int, run_dir: str) -> dict:
    """4 steps straight vs 2 steps + checkpoint, then a fresh trainer resuming for steps 3-4."""
    from piper_plan.planfile import parse_plan_dict
    from piper_plan.runtime.train import Trainer

    cfg = parse_plan_dict(plan, "test plan")
    straight = Trainer(cfg, rank, world, torch.device("cpu"), lr=1e-2, aux_loss_coeff=0.01)
    full = [straight.train_step(s).report()["loss"] for s in range(4)]
    first = Trainer(cfg, rank, world, torch.device("cpu"), lr=1e-2, aux_loss_coeff=0.01)
    part = [first.train_step(s).report()["loss"] for s in range(2)]
    first.save(Path(run_dir), 2)
    torch.manual_seed(1234)  # disturb the RNG: resume must restore it
    second = Trainer(cfg, rank, world, torch.device("cpu"), lr=1e-2, aux_loss_coeff=0.01)
    start, _ = second.resume(Path(run_dir))
    part += [second.train_step(s).report()["loss"] for s in range(start, 4)]
    return {"full": full, "resumed": part, "start": start}


def tp_accounting(rank: int, world: int, models: dict, seq_len: int) -> dict:
    """Per model (name -> (spec dict, stage layer splits)): this tp rank's parameter counts of every stage built
    and split over tp = world, and (one stage) the peak bytes autograd saves for backward in one forward."""
    from torch.distributed.device_mesh import init_device_mesh

    from piper_plan.runtime.accounting import SavedTensorTracker, param_counts
    from piper_plan.runtime.model import StageModel, init_stage
    from piper_plan.runtime.pipeline import lm_loss
    from piper_plan.runtime.tensor_parallel import loss_context, parallelize
    from piper_plan.specs import ModelSpec

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for name, (data, splits) in models.items():
        spec = ModelSpec.model_validate(data)
        counts = {}
        for layers in splits:
            per_stage = []
            for stage, n in enumerate(layers):
                module = StageModel(spec, sum(layers[:stage]), n)
                init_stage(module, 0)
                parallelize(module, mesh)
                per_stage.append(param_counts(module))
            counts[len(layers)] = per_stage
        torch.manual_seed(0)
        module = StageModel(spec, 0, spec.num_layers, {"seq_mesh": mesh})
        init_stage(module, 0)
        parallelize(module, mesh)
        tracker = SavedTensorTracker(module)
        x = torch.randint(0, spec.vocab_size, (1, seq_len + 1))
        with loss_context(world):
            with tracker.hooks():
                loss = lm_loss(module(x[:, :-1]), x[:, 1:])
            loss.backward()
        out[name] = {"params": counts, "saved_bytes": tracker.peak_bytes}
    return out


def agreed_latest(rank: int, world: int, root: Path) -> list:
    """checkpoint._agreed_latest_step where the ranks see (a) the same checkpoint, (b) a checkpoint only rank 0
    sees (a run directory not shared), (c) a damaged one only the last rank sees: the step, else the message."""
    from piper_plan.errors import PiperError
    from piper_plan.runtime.checkpoint import _agreed_latest_step

    out = []
    for case, latest in (("same", "4\n"), ("only0", "4\n" if rank == 0 else None),
                         ("damaged", "x\n" if rank == world - 1 else "4\n")):
        run_dir = root / case / f"rank{rank}"
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        if latest is not None:
            (run_dir / "checkpoints" / "latest").write_text(latest)
        try:
            out.append(_agreed_latest_step(run_dir, world))
        except PiperError as exc:
            out.append(str(exc))
    return out


def worker(rank: int, world: int, port: int, jobs: list, out_dir: str) -> None:
    init(rank, world, port)
    results = {}
    for name, kind, kwargs in jobs:
        if kind == "train":
            results[name] = train_and_record(kwargs["plan"], rank, world, kwargs["steps"], kwargs["aux"])
        elif kind == "dispatch":
            results[name] = dispatch_checks(rank, world)
        elif kind == "tp_accounting":
            results[name] = tp_accounting(rank, world, kwargs["models"], kwargs["seq_len"])
        elif kind == "resume":
            results[name] = resume_check(kwargs["plan"], rank, world, kwargs["run_dir"])
        elif kind == "overlap":
            results[name] = overlap_check(kwargs["plan"], rank, world, kwargs["bucket_bytes"])
        elif kind == "agreed_latest":
            results[name] = agreed_latest(rank, world, Path(kwargs["root"]))
        elif kind == "first_failed":
            from piper_plan.runtime.train import first_failed_rank

            results[name] = [first_failed_rank(rank in failed, rank, world, torch.device("cpu"))
                             for failed in kwargs["cases"]]
    finish(results, rank, out_dir)


def finish(results: dict, rank: int, out_dir) -> None:
    """A spawned rank's last act: its results saved, its process group ended as `piper run`'s ranks end it
    (runtime.mesh.end_process_group), and the process left at once, as they leave (os._exit: no interpreter
    teardown, where a rank that used DTensor or FSDP2 may still abort; environment.md). A rank of
    test_two_ranks_tp2, which ended with neither, died once in CI of SIGABRT ("malloc(): unaligned tcache chunk
    detected"; where in the rank is unknown: no stack was printed, as faulthandler now makes it)."""
    import sys

    import torch.distributed as dist

    from piper_plan.runtime.mesh import end_process_group

    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    if dist.is_initialized():                    # a job that ran `piper run`'s own code has ended it already
        end_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(world: int, jobs: list, out_dir: Path, target=None) -> list[dict]:
    """Run ``target(rank, world, port, jobs, out_dir)`` (default: this module's worker) on ``world`` spawned
    ranks; every rank's saved results, in rank order."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(target or worker, args=(world, port, jobs, str(out_dir)), nprocs=world, start_method="spawn")
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]
