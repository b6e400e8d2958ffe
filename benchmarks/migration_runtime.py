"""Live expert migration in the torch runtime: migration time as a share of training time (CPU, gloo).

The Piper paper claims the amortised cost of expert migration is under 5% of training time
(reference/piper-paper.md, "Expert migration"). This runs the real runtime (``runtime.train.Trainer``, flat
all-to-all, AdamW) on spawned gloo ranks with a **skewed router**: the router bias of every MoE layer is set to
``-s ln(e + 1)`` for logical expert e, a Zipf prior (softmax probability ~ 1 / (e + 1)^s before the token-
dependent logits), so the most popular experts all start on EP rank 0 (the worst case). Every ``--interval``
steps the runtime's own ``runtime.migration.ExpertMigrator`` (configured by plan.json's ``migration`` block)
gathers the loads, plans with hill climbing and moves the experts with their gradients and Adam state; each
step's reports are merged into metrics.jsonl records exactly as ``train.run`` does. Prints: step time,
migration seconds (gather + plan + move, see ``runtime.migration.merge_events``), migration share of the total
time (``runtime.metrics.migration_summary``), bytes moved, and the measured imbalance (max / mean rows computed
per EP rank) before and after the first migration. Timings on a shared 2-core machine say little about a GPU system;
the share is the figure to read, and it depends on --interval (the plan's default is 50 steps).

    .venv/bin/python benchmarks/migration_runtime.py [--world 4] [--ep 4] [--steps 40] [--interval 10]
        [--skew 1.2] [--hidden 128] [--ffn 512] [--layers 4] [--experts 8] [--events] [--json]
    .venv/bin/python benchmarks/migration_runtime.py --sweep --steps 50 [--out docs/migration-runtime.md]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import tempfile
from pathlib import Path


def plan_dict(args) -> dict:
    """plan.json's format (piper_plan/planfile.py) for a CPU run of a widened tiny-moe on ``args.world`` ranks (pp = 1)."""
    from piper_plan.catalog import load_model, load_platform

    model = load_model("tiny-moe").model_dump(mode="json")
    model.update(hidden_size=args.hidden, num_layers=args.layers)
    model["moe"].update(num_experts=args.experts, router_bias=True)
    model["moe"]["expert"]["intermediate_size"] = args.ffn
    platform = load_platform("local-cpu").model_dump(mode="json")
    platform["name"] = "cpu-bench"
    platform["launch"] = {**platform["launch"], "device": "cpu", "backend": "gloo", "gpus_per_task": 0}
    platform["node"].update(devices_per_node=args.world, device_nic=None)    # one node of --world CPU ranks
    dp = args.world
    parallel = {"dp": dp, "tp": 1, "pp": 1, "ep": args.ep, "etp": 1, "edp": dp // args.ep, "mbs": 1,
                "num_microbatches": 2, "schedule": "1f1b", "virtual_stages": 1, "recompute": "none", "zero": 0,
                "a2a": "flat", "layers_per_stage": None}
    training = {"seq_len": args.seq_len, "global_batch": dp * 2, "dtype": "fp32", "weight_bytes": 4,
                "grad_bytes": 4, "master_bytes": 0}
    return {"schema_version": 1, "piper_version": "bench", "model": model, "platform": platform,
            "training": training, "nodes": 1, "placement": "compact", "parallel": parallel,
            "moe": {"capacity_factor": None},
            "migration": {"enabled": True, "threshold": args.threshold, "interval": args.interval,
                          "max_iters": args.max_iters},
            "runtime": {"data": None, "steps": args.steps, "checkpoint_interval": args.steps, "seed": 0}, "prediction": {}}


def zipf_bias(num_experts: int, skew: float) -> list[float]:
    """Router bias -s ln(e + 1): softmax prior ~ (e + 1)^-s (Zipf's law, exponent s)."""
    return [-skew * math.log(e + 1) for e in range(num_experts)]


def worker(rank: int, world: int, port: int, plan: dict, args, out_dir: str) -> None:
    """One rank: the runtime's Trainer (its own ExpertMigrator, from plan.json's migration block) and, as
    train.run does, every step's reports gathered and merged into a metrics.jsonl record on rank 0."""
    import torch
    import torch.distributed as dist

    from piper_plan.planfile import parse_plan_dict
    from piper_plan.runtime.mesh import end_process_group
    from piper_plan.runtime.train import Trainer, merge_reports

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = parse_plan_dict(plan, "migration benchmark plan")
    trainer = Trainer(cfg, rank, world, torch.device("cpu"), lr=1e-3, aux_loss_coeff=0.0)
    assert trainer.migrator is not None, "plan.json's migration block did not enable the runtime's migrator"
    with torch.no_grad():
        for m in trainer.module.moe_layers().values():
            m.router.bias.copy_(torch.tensor(zipf_bias(args.experts, args.skew)))
    rows = _row_counter(trainer)
    tokens = plan["training"]["global_batch"] * plan["training"]["seq_len"]
    records, loads = [], []
    for step in range(args.steps):
        rows["n"] = 0
        report = trainer.train_step(step).report()
        report["rows"] = (trainer.mesh.me.ep_group_index, rows["n"])
        gathered = [None] * world
        dist.all_gather_object(gathered, report)
        if rank == 0:
            records.append(merge_reports(gathered, step + 1, tokens))
            loads.append([g["rows"] for g in gathered])
    if rank == 0:
        (Path(out_dir) / "records.json").write_text(json.dumps({"records": records, "rows": loads}))
    end_process_group()


def _row_counter(trainer) -> dict:
    """Rows each rank's local experts compute in forward (a pre-hook on LocalExperts)."""
    import torch

    counter = {"n": 0}

    def hook(module, inputs):
        if torch.is_grad_enabled():
            counter["n"] += int(sum(inputs[1]))

    for m in trainer.module.moe_layers().values():
        m.experts.register_forward_pre_hook(hook)
    return counter


def summarise_run(records: list[dict], rows: list[list], args) -> dict:
    """metrics.jsonl records -> the run's figures (runtime.metrics.summarise + the imbalance per step)."""
    from piper_plan.runtime.metrics import summarise

    summary = summarise(records)
    boundaries = [i for i, r in enumerate(records) if r["migrations"]]
    first = boundaries[0] + 1 if boundaries else len(records)
    imbalance = [_imbalance(step_rows) for step_rows in rows]
    checks = [e for r in records for e in r["migrations"]]
    return {"steps": len(records), "world": args.world, "ep": args.ep, "experts": args.experts, "skew": args.skew,
            "interval": args.interval, "train_s": sum(r["step_time_s"] for r in records),
            "migration_s": summary["migration"]["seconds"], "migration_share": summary["migration"]["share"],
            "mean_step_s": summary["step_time_s"], "checks": len(checks), "swaps": summary["migration"]["swaps"],
            "mean_migration_s": summary["migration"]["seconds"] / max(1, len(boundaries)),
            "mean_parts_s": {k: sum(e[k] for e in checks) / max(1, len(boundaries))
                             for k in ("gather_s", "plan_s", "move_s")},
            "bytes_moved": sum(e["bytes_moved"] for e in checks),
            "imbalance_before": sum(imbalance[:first]) / first,
            "imbalance_after": sum(imbalance[first:]) / (len(records) - first) if first < len(records) else None,
            "step_s_before": _mean([r["step_time_s"] for r in records[1:first]]),
            "step_s_after": _mean([r["step_time_s"] for r in records[first:]])}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _imbalance(step_rows: list) -> float:
    """max / mean rows computed per EP rank in one step, averaged over the EP groups."""
    groups: dict[int, list[int]] = {}
    for group, n in step_rows:
        groups.setdefault(group, []).append(n)
    ratios = [max(g) / (sum(g) / len(g)) for g in groups.values() if sum(g)]
    return sum(ratios) / len(ratios)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{1e3 * seconds:.1f} ms"


def print_table(s: dict) -> None:
    lines = [
        f"world {s['world']} ranks, ep {s['ep']}, {s['experts']} experts, Zipf router skew {s['skew']}, "
        f"{s['steps']} steps, migration every {s['interval']} steps ({s['checks']} checks, {s['swaps']} swaps)",
        f"training {s['train_s']:.2f} s + migration {s['migration_s']:.3f} s",
        f"migration share of total time: {100 * s['migration_share']:.2f} %  (paper: < 5 %)",
        f"mean step {1e3 * s['mean_step_s']:.1f} ms; mean migration {1e3 * s['mean_migration_s']:.1f} ms per check; "
        f"bytes moved {s['bytes_moved'] / 1e6:.2f} MB",
        "mean per check (gather: the last rank to arrive; plan, move: the slowest rank): "
        + ", ".join(f"{k[:-2]} {1e3 * v:.1f} ms" for k, v in s["mean_parts_s"].items()),
        f"imbalance (max/mean rows per EP rank): before {s['imbalance_before']:.3f}, after "
        + (f"{s['imbalance_after']:.3f}" if s["imbalance_after"] is not None else "n/a"),
        f"step time before first migration {_ms(s['step_s_before'])}, after {_ms(s['step_s_after'])}",
    ]
    print("\n".join(lines))


def print_events(records: list[dict]) -> None:
    for r in records:
        for e in r["migrations"]:
            parts = ", ".join(f"{k[:-2]} {1e3 * e[k]:.1f} ms" for k in ("gather_s", "plan_s", "move_s"))
            print(f"step {r['step']} stage {e['stage']}: {e['num_swaps']} swaps, {e['bytes_moved'] / 1e6:.2f} MB, "
                  f"{parts}; max/mean {e['max_over_mean_before']:.3f} -> {e['max_over_mean_after']:.3f}; "
                  f"step {1e3 * r['step_time_s']:.1f} ms")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--threshold", type=float, default=1.1)
    ap.add_argument("--max-iters", type=int, default=16)
    ap.add_argument("--skew", type=float, default=1.2, help="Zipf exponent of the router-bias prior")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=512, help="expert intermediate size")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--events", action="store_true", help="also print every migration check")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")
    ap.add_argument("--sweep", action="store_true", help="skew 0.8/1.2/1.5 x interval 1/10/50: a markdown table")
    ap.add_argument("--out", default=None, help="with --sweep: also write the table to this file")
    return ap.parse_args(argv)


def run_once(args) -> tuple[dict, list[dict]]:
    """One spawned training run -> (figures, metrics.jsonl records)."""
    import torch.multiprocessing as mp

    plan = plan_dict(args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args.world, port, plan, args, tmp), nprocs=args.world, start_method="spawn")
        data = json.loads((Path(tmp) / "records.json").read_text())
    return summarise_run(data["records"], data["rows"], args), data["records"]


SWEEP_SKEWS = (0.8, 1.2, 1.5)
SWEEP_INTERVALS = (1, 10, 50)
SWEEP_COLUMNS = ("skew", "interval", "checks", "swaps", "MB moved", "migration ms/check", "step ms",
                 "migration share %", "max/mean before", "after")


def sweep(args) -> list[dict]:
    """Every (skew, interval) of SWEEP_SKEWS x SWEEP_INTERVALS with the other options as given."""
    rows = []
    for skew in SWEEP_SKEWS:
        for interval in SWEEP_INTERVALS:
            summary, _ = run_once(argparse.Namespace(**{**vars(args), "skew": skew, "interval": interval}))
            rows.append(summary)
            print(" | ".join(_cells(summary)), file=sys.stderr)
    return rows


def _cells(s: dict) -> list[str]:
    after = "n/a" if s["imbalance_after"] is None else f"{s['imbalance_after']:.3f}"
    return [f"{s['skew']}", str(s["interval"]), str(s["checks"]), str(s["swaps"]), f"{s['bytes_moved'] / 1e6:.2f}",
            f"{1e3 * s['mean_migration_s']:.1f}", f"{1e3 * s['mean_step_s']:.1f}",
            f"{100 * s['migration_share']:.2f}", f"{s['imbalance_before']:.3f}", after]


def markdown(rows: list[dict], args) -> str:
    """A docs page: how it was run, the columns, the table."""
    head = ["# Live expert migration in the runtime: time share (CPU, gloo)", "",
            f"Generated by `.venv/bin/python benchmarks/migration_runtime.py --sweep --steps {args.steps} "
            f"--world {args.world} --ep {args.ep} --experts {args.experts} --hidden {args.hidden} --ffn {args.ffn} "
            f"--layers {args.layers}` on a shared 2-core CPU machine (gloo over loopback): the share, not the "
            "absolute times, is the figure to read. The paper claims an amortised cost under 5% of training time.",
            "", "Router: bias -s ln(e + 1) on logical expert e (a Zipf prior; the popular experts start together on "
            "EP rank 0). max/mean: rows computed per EP rank, measured, before / after the first migration check. "
            "Migration = loads gather + hill-climbing plan + point-to-point move of weights, gradients and Adam state.",
            "", "| " + " | ".join(SWEEP_COLUMNS) + " |", "|" + "---|" * len(SWEEP_COLUMNS)]
    return "\n".join(head + ["| " + " | ".join(_cells(r)) + " |" for r in rows]) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.sweep:
        rows = sweep(args)
        text = markdown(rows, args)
        print(text)
        if args.out:
            from piper_plan.fileio import atomic_write_text

            atomic_write_text(Path(args.out), text)
        return 0
    summary, records = run_once(args)
    if args.events:
        print_events(records)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_table(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
