"""Spawned rank for tests/runtime/test_halo.py: runs many prepared HALO cases in one process group.

The parent generates every case (hypothesis) and hands them over; each rank writes
``{"checks": n, "errors": [...]}`` to ``<out_dir>/rank<r>.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def run_cases(rank: int, num_ranks: int, init_method: str, timeout_s: float,
              topo: tuple[int, int], configs: list[dict], out_dir: str, train_plans: dict | None = None) -> None:
    """configs: [{"ep_groups": [[ranks]], "cases": [{"counts": [[P x P] per group], "dim", "seed"}]}].

    With ``train_plans`` ({name: plan dict}), also train each for 2 steps (see ``train_runs``).
    """
    import os

    os.environ["PIPER_EMULATE_TOPOLOGY"] = f"{topo[0]}x{topo[1]}"  # what the trainer's topology_from_env reads

    from piper_plan.calibration.bench_a2a import init_gloo
    from piper_plan.runtime.mesh import end_process_group

    init_gloo(rank, num_ranks, init_method, timeout_s)
    checks, errors = 0, []
    try:
        topology = _topology(topo)
        for config in configs:
            n, errs = _run_config(config, topology)
            checks, errors = checks + n, errors + errs
        if train_plans:
            train_runs(rank, num_ranks, train_plans, 2, out_dir)
    except Exception as exc:  # reported to the parent, which fails the test with the message
        errors.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"checks": checks, "errors": errors}))
        end_process_group()


def _topology(topo: tuple[int, int]):
    from piper_plan.runtime.topology import emulated_topology

    nodes, per_node = topo
    # Two ranks share a NIC, as the two GCDs of an MI250X do on Frontier (platforms/frontier.yaml).
    return emulated_topology(nodes, per_node, per_node, [i // 2 for i in range(per_node)])


def _run_config(config: dict, topology) -> tuple[int, list[str]]:
    import torch.distributed as dist

    from piper_plan.calibration.bench_a2a import verify_exchange
    from piper_plan.runtime.halo import build_halo_dispatchers

    halo = build_halo_dispatchers(config["ep_groups"], topology)
    if halo is None:
        return 0, []
    which = next(i for i, g in enumerate(config["ep_groups"]) if dist.get_rank() in g)
    checks, errors = 0, []
    for case in config["cases"]:
        counts = np.asarray(case["counts"][which], dtype=np.int64)
        errors += verify_exchange(halo, counts, case["dim"], case["seed"])
        checks += 5
    errors += _against_flat_dispatcher(halo, config["cases"][0]["counts"][which])
    return checks + 3, errors


def _against_flat_dispatcher(halo, counts_PP) -> list[str]:
    """Gradients through HALO == gradients through the runtime's FlatDispatcher; per-expert layouts agree."""
    import torch

    from piper_plan.runtime.dispatch import FlatDispatcher

    flat = FlatDispatcher(halo.group)
    send = torch.tensor(counts_PP[halo.me], dtype=torch.int64)
    gen = torch.Generator().manual_seed(7 + halo.me)
    x = torch.randn(int(send.sum()), 4, generator=gen, dtype=torch.float64)
    grads, outs = [], []
    for disp in (halo, flat):
        leaf = x.clone().requires_grad_(True)
        layout = disp.layout(send)
        y = disp.dispatch(leaf, layout)
        back = disp.combine(y * (1.0 + y), layout)  # a non-linear expert stand-in between the exchanges
        (back * x).sum().backward()
        outs.append(back.detach())
        grads.append(leaf.grad)
    errors = [] if torch.equal(outs[0], outs[1]) else [f"rank {halo.me}: combine(dispatch) != FlatDispatcher's"]
    errors += [] if torch.equal(grads[0], grads[1]) else [f"rank {halo.me}: gradient != FlatDispatcher's"]
    per_expert = torch.arange(len(halo.ep_ranks) * 2, dtype=torch.int64).reshape(-1, 2) % 3
    if halo.layout(per_expert).recv_expert_counts != flat.layout(per_expert).recv_expert_counts:
        errors.append(f"rank {halo.me}: per-expert layout differs from FlatDispatcher's")
    return errors


def train_runs(rank: int, num_ranks: int, plans: dict, steps: int, out_dir: str) -> None:
    """Train each plan (a2a flat / halo) for ``steps`` steps; save losses, gradients and the dispatcher used."""
    import torch

    from piper_plan.planfile import parse_plan_dict
    from piper_plan.runtime.train import Trainer

    out = {}
    for name, plan in plans.items():
        trainer = Trainer(parse_plan_dict(plan, "test plan"), rank, num_ranks, torch.device("cpu"), lr=1e-2,
                          aux_loss_coeff=0.01)
        layers = trainer.module.moe_layers()
        record = {"losses": [], "grads": [], "dispatcher": type(next(iter(layers.values())).dispatcher).__name__}
        for step in range(steps):
            record["losses"].append(trainer.train_step(step).report()["loss"])
            record["grads"].append({n: q.grad.clone() for n, q in trainer.module.named_parameters()})
        out[name] = record
    torch.save(out, Path(out_dir) / f"train{rank}.pt")
