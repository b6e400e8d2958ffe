"""Code that runs inside spawned gloo ranks for tests/runtime/test_migration_runtime.py (one spawn, several jobs)."""

from __future__ import annotations

import os

import torch

from piper_plan.placement.migration import Swap
from piper_plan.planfile import MigrationBlock
from piper_plan.runtime.migration import ExpertMigrator, apply_swaps


def _trainer(plan: dict, rank: int, world: int, aux: float = 0.0, router_bias=None):
    from piper_plan.planfile import parse_plan_dict
    from piper_plan.runtime.train import Trainer

    trainer = Trainer(parse_plan_dict(plan, "test plan"), rank, world, torch.device("cpu"), lr=1e-2, aux_loss_coeff=aux)
    if router_bias is not None:
        with torch.no_grad():
            for m in trainer.module.moe_layers().values():
                m.router.bias.copy_(torch.tensor(router_bias))
    return trainer


def logical_experts(trainer) -> dict:
    """{(layer, logical expert): {tensor name: value}} for the experts this rank holds: weights, and Adam's
    exp_avg / exp_avg_sq where this rank has them."""
    states = [getattr(o, "optim", o).state for o in trainer.optimizer.optims]
    out = {}
    for layer, m in trainer.module.moe_layers().items():
        lo = m.first_expert  # first slot of this rank
        for e, slot in enumerate(m.slot_of_expert.tolist()):
            if not lo <= slot < lo + m.num_local:
                continue
            j, entry = slot - lo, {}
            for name, p in m.experts.named_parameters():
                entry[name] = p.data[j].clone()
                for st in states:
                    for key in ("exp_avg", "exp_avg_sq"):
                        if key in st.get(p, {}):
                            entry[f"{name}.{key}"] = st[p][key][j].clone()
            out[(layer, e)] = entry
    return out


def stage_output(trainer, rank: int) -> torch.Tensor:
    """The stage module's output on a fixed input (tokens on the first stage, a seeded hidden state elsewhere)."""
    x, _ = trainer.batch(0)
    if not trainer.module.is_first:
        gen = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(x.shape + (trainer.cfg.model.hidden_size,), generator=gen)
    with torch.no_grad():
        return trainer.module(x)


def function_check(plan: dict, rank: int, world: int) -> dict:
    """Outputs before / after a forced permutation (cross-rank swaps, a chain, a local move) on every layer;
    the logical experts' tensors before / after. Two steps are trained first so Adam state and grads exist."""
    trainer = _trainer(plan, rank, world, aux=0.01)
    for step in range(2):
        trainer.train_step(step)
    migrator = ExpertMigrator.from_trainer(trainer, MigrationBlock(threshold=1.0, interval=1))
    before_out, before_experts = stage_output(trainer, rank), logical_experts(trainer)
    n, E = migrator.num_local, trainer.cfg.model.moe.num_experts
    swaps = []
    for row in range(len(migrator.layers)):
        a, b = row % n, E - 1 - row % n  # rank 0 <-> last rank
        c = (row + 1) % n if (row + 1) % n != a else (row + 2) % n  # then a again: a ends on rank 0 (local move)
        swaps += [Swap(row, a, 0, b, b // n), Swap(row, a, b // n, c, 0)]
    slots_before = migrator.slot_maps()
    sent = migrator.apply(slots_before, apply_swaps(slots_before, swaps))
    return {"before": before_out, "after": stage_output(trainer, rank), "bytes_sent": sent,
            "experts_before": before_experts, "experts_after": logical_experts(trainer),
            "slots_before": slots_before, "slots_after": migrator.slot_maps(), "stage": trainer.mesh.me.pp_index,
            "ep_ranks": migrator.ep_ranks}


def train_check(plan: dict, rank: int, world: int, steps: int, migrate: bool, router_bias=None,
                settings: MigrationBlock | None = None) -> dict:
    """``steps`` steps, migrating at every boundary (threshold 1.0) or never; losses, events, rows per step."""
    trainer = _trainer(plan, rank, world, router_bias=router_bias)
    rows = _count_rows(trainer)
    settings = settings or MigrationBlock(threshold=1.0, interval=1, max_iters=4)
    migrator = ExpertMigrator.from_trainer(trainer, settings) if migrate else None
    out = {"losses": [], "events": [], "rows": [], "slots": [], "expert_tokens": []}
    for step in range(steps):
        rows["n"] = 0
        report = trainer.train_step(step).report()
        out["losses"].append(report["loss"])
        out["expert_tokens"].append(report["expert_tokens"])
        out["rows"].append(rows["n"])
        if migrator is not None:
            migrator.observe()
            out["events"].append(migrator.step_boundary(step))
            out["slots"].append(migrator.slot_maps())
    out["experts"] = logical_experts(trainer)
    out["dispatcher"] = type(next(iter(trainer.module.moe_layers().values())).dispatcher).__name__
    out["stage"], out["ep_group"] = trainer.mesh.me.pp_index, trainer.mesh.me.ep_group_index
    out["ep_rank"] = trainer.mesh.me.ep_rank
    out["local_weights"] = {n: p.data.clone() for n, p in trainer.module.named_parameters() if ".experts." in n}
    out["router"] = {i: m.router.weight.data.clone() for i, m in trainer.module.moe_layers().items()}
    return out


def resume_check(plan: dict, rank: int, world: int, run_dir: str) -> dict:
    """The runtime's own migration (plan.json block): 4 steps straight vs 2 + checkpoint + a fresh trainer
    resuming for steps 3-4; the placement (MoE.slot_of_expert) travels in the checkpoint."""
    from pathlib import Path

    from piper_plan.planfile import parse_plan_dict
    from piper_plan.runtime.train import Trainer

    cfg = parse_plan_dict(plan, "test plan")
    straight = Trainer(cfg, rank, world, torch.device("cpu"), lr=1e-2)
    reports = [straight.train_step(s).report() for s in range(4)]
    first = Trainer(cfg, rank, world, torch.device("cpu"), lr=1e-2)
    part = [first.train_step(s).report()["loss"] for s in range(2)]
    first.save(Path(run_dir), 2)
    second = Trainer(cfg, rank, world, torch.device("cpu"), lr=1e-2)
    start, _ = second.resume(Path(run_dir))
    part += [second.train_step(s).report()["loss"] for s in range(start, 4)]
    return {"full": [r["loss"] for r in reports], "resumed": part, "events": [r["migration"] for r in reports],
            "slots_full": straight.migrator.slot_maps(), "slots_resumed": second.migrator.slot_maps()}


def cli_check(plan_path: str, rank: int, world: int, run_dir: str, steps: int) -> int:
    """train.run as the command line runs it (it ends the process group: the last job of a spawn)."""
    from piper_plan.runtime.train import load_plan, parse_args, run

    args = parse_args(["--plan", plan_path, "--out", run_dir, "--steps", str(steps)])
    return run(load_plan(args), args, rank, world, 0)


def _count_rows(trainer) -> dict:
    """Rows this rank's local experts compute (forward passes only), via a pre-hook on LocalExperts."""
    counter = {"n": 0}

    def hook(module, args):
        if torch.is_grad_enabled():
            counter["n"] += int(sum(args[1]))

    for m in trainer.module.moe_layers().values():
        m.experts.register_forward_pre_hook(hook)
    return counter


def worker(rank: int, world: int, port: int, jobs: list, out_dir: str) -> None:
    from workers import finish, init

    os.environ["PIPER_EMULATE_TOPOLOGY"] = f"2x{world // 2}"  # only plans with a2a="halo" read it
    init(rank, world, port)
    results = {}
    for name, kind, kwargs in jobs:
        fn = {"function": function_check, "train": train_check, "resume": resume_check, "cli": cli_check}[kind]
        results[name] = fn(rank=rank, world=world, **kwargs)
    finish(results, rank, out_dir)


def spawn(world: int, jobs: list, out_dir) -> list[dict]:
    import socket
    from pathlib import Path

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(world, port, jobs, str(out_dir)), nprocs=world, start_method="spawn")
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]
