"""Code that runs inside spawned gloo ranks for tests/runtime/test_fsdp_runtime.py (one spawn per world size,
several jobs): training with zero 2/3 (FSDP2) recording losses, full gradients and the global gradient norm;
a migrating vs a static run; collective counts and peak bytes (benchmarks/zero_memory.py reads the same)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def _trainer(plan: dict, rank: int, world: int, aux: float):
    from piper_plan.planfile import parse_plan_dict
    from piper_plan.runtime.train import Trainer

    return Trainer(parse_plan_dict(plan, "test plan"), rank, world, torch.device("cpu"), lr=1e-2, aux_loss_coeff=aux)


def full_grads(trainer) -> dict:
    """Every gradient of this rank, a sharded one gathered (``full_tensor()``, collective over its mesh)."""
    from piper_plan.runtime.sharding import is_sharded

    out = {}
    for name, q in trainer.module.named_parameters():
        g = q.grad
        out[name] = (g.full_tensor() if is_sharded(g) else g).detach().clone()
    return out


def train_check(plan: dict, rank: int, world: int, steps: int, aux: float, migrate: bool = False) -> dict:
    """``steps`` steps; per step the loss (last stage), full gradients, the global grad norm; migration at every
    step boundary (threshold 1.0) when ``migrate``; at the end the logical experts' local shards."""
    from piper_plan.planfile import MigrationBlock
    from piper_plan.runtime.migration import ExpertMigrator

    trainer = _trainer(plan, rank, world, aux)
    migrator = ExpertMigrator.from_trainer(trainer, MigrationBlock(threshold=1.0, interval=1, max_iters=4)) \
        if migrate else None
    from workers import full_params

    out = {"losses": [], "grads": [], "grad_norm": [], "swaps": 0, "init": full_params(trainer.module)}
    for step in range(steps):
        report = trainer.train_step(step).report()
        out["losses"].append(report["loss"])
        out["grads"].append(full_grads(trainer))
        out["grad_norm"].append(float(trainer.grad_norm))
        if migrator is not None:
            migrator.observe()
            event = migrator.step_boundary(step)
            out["swaps"] += event["num_swaps"] if event else 0
    out["first_expert"] = {i: m.first_expert for i, m in trainer.module.moe_layers().items()}
    out["experts"] = logical_shards(trainer)
    out["ep_group"] = trainer.mesh.me.ep_group_index
    out["sharded"] = sorted(n for n, q in trainer.module.named_parameters() if _is_dtensor(q))
    out["mesh_shapes"] = sorted({tuple(q.device_mesh.mesh.shape) for q in trainer.module.parameters()
                                 if _is_dtensor(q)})
    return out


def _is_dtensor(t) -> bool:
    from piper_plan.runtime.sharding import is_sharded

    return is_sharded(t)


def logical_shards(trainer) -> dict:
    """{(layer, logical expert): {name: local shard}} of the experts this rank holds: weights, grads, Adam state."""
    from piper_plan.runtime.sharding import local

    states = [getattr(o, "optim", o).state for o in trainer.optimizer.optims]
    out = {}
    for layer, m in trainer.module.moe_layers().items():
        lo = m.first_expert
        for e, slot in enumerate(m.slot_of_expert.tolist()):
            if not lo <= slot < lo + m.num_local:
                continue
            j, entry = slot - lo, {}
            for name, p in m.experts.named_parameters():
                entry[name] = local(p.data)[j].clone()
                entry[f"{name}.grad"] = local(p.grad)[j].clone()
                for st in states:
                    for key in ("exp_avg", "exp_avg_sq"):
                        if key in st.get(p, {}):
                            entry[f"{name}.{key}"] = local(st[p][key])[j].clone()
            out[(layer, e)] = entry
    return out


def _numel(params) -> int:
    return sum(q.numel() for q in params)  # a DTensor's numel is the whole tensor's


def stage_numels(trainer) -> dict:
    """Whole-tensor element counts of this rank's stage: dense, routed experts (its El per layer), the largest
    block's dense and expert parts, and the stage root's own (embedding, final norm, head)."""
    from piper_plan.runtime.sharding import stage_roots

    blocks = [b for stage in stage_roots(trainer.module) for b in stage.layers.values()]
    split = [(_numel(q for n, q in b.named_parameters() if ".experts." not in f".{n}"),
              _numel(q for n, q in b.named_parameters() if ".experts." in f".{n}")) for b in blocks]
    return {"dense": _numel(trainer.dense), "expert": _numel(trainer.expert),
            "root": _numel(trainer.dense) - sum(d for d, _ in split),
            "block_dense_max": max(d for d, _ in split), "block_expert_max": max(e for _, e in split)}


def measure_check(plan: dict, rank: int, world: int) -> dict:
    """Step 1 (after a step 0 that creates the optimizer state) of a plan: the runtime's accounting (parameters
    at rest, gradients after the step, optimizer state, saved activations), the peaks of gathered parameters and
    of gradients during the step (accounting.StatePeaks), the data-parallel collectives, and the stage's numels."""
    from piper_plan.runtime.accounting import CollectiveCounter, StatePeaks

    trainer = _trainer(plan, rank, world, aux=0.0)
    trainer.train_step(0)
    peaks = StatePeaks(trainer.module, trainer.dense + trainer.expert)
    trainer.tracker.on_sample = peaks.sample
    with CollectiveCounter() as counter:
        report = trainer.train_step(1).report()
    return {"memory": report["memory"], "peaks": peaks.peak, "collectives": counter.calls,
            "numel": stage_numels(trainer), "stage": trainer.mesh.me.pp_index}


def worker(rank: int, world: int, port: int, jobs: list, out_dir: str) -> None:
    from workers import finish, init, resume_check

    os.environ["PIPER_EMULATE_TOPOLOGY"] = f"{world}x1"  # only plans with a2a="halo" read it: a node per rank
    init(rank, world, port)
    results = {}
    for name, kind, kwargs in jobs:
        fn = {"train": train_check, "measure": measure_check, "resume": resume_check}[kind]
        results[name] = fn(rank=rank, world=world, **kwargs)
    finish(results, rank, out_dir)


def spawn(world: int, jobs: list, out_dir) -> list[dict]:
    import workers

    return workers.spawn(world, jobs, Path(out_dir), target=worker)
