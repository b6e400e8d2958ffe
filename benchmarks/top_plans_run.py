#!/usr/bin/env python
"""Every plan piper ranks is a plan piper runs: the top 10 plans of `piper plan` (default space) for three
settings, each through `piper launch --plan ... --dry-run`, and each distinct layout, shrunk, trained 3 steps.

Shrinking (issue 15): every degree above 1 becomes 2 (pp, dp, tp, ep; at most 8 ranks), schedule, virtual
stages, recompute, zero and a2a are kept, and the model is cut by ``runtime.model.shrink_spec`` (4 layers, width
64, <= 8 experts); the shrunk plans run on this machine's CPU platform (platforms/local-cpu.yaml, fp32, gloo),
all layouts of one world size in one torchrun (one process group, one Trainer per layout).

DeepSeek-V3 is planned, launched and trained with its MTP module (the catalog's ``mtp_layers``: 1; the shrunk
model keeps it).

Run: ``python benchmarks/top_plans_run.py [--out DIR] [--top 10] [--cases mixtral,deepseek,qwen]``.
Prints one row per ranked plan, then one per shrunk layout (3 losses, or why the runtime refused it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = {"mixtral": ("mixtral-8x7b", "frontier", 8), "deepseek": ("deepseek-v3", "frontier", 128),
         "qwen": ("qwen3-235b-a22b", "dgx-h100", 32)}
MTP_LAYERS: dict[str, int] = {}
"""MTP modules trained per case (``piper plan --mtp-layers``; absent: all the model defines, DeepSeek-V3's one
included: the runtime builds it, runtime/model.py MTPModule)."""
SHRUNK_PLATFORM = "local-cpu"
STEPS = 3


# ---- the ranked plans and their launch dry runs ------------------------------------------------------
def ranked_plans(case: str, top: int, out: Path) -> list[dict]:
    """The top plans of one setting, each written as plan.json and put through `piper launch --dry-run`."""
    from piper_plan.catalog import load_model, load_platform
    from piper_plan.cli.options import with_mtp_layers
    from piper_plan.cli.plan import search_kwargs
    from piper_plan.planfile import write_plan_file
    from piper_plan.search.engine import search
    from piper_plan.search.report import ranked_plan
    from piper_plan.search.space import SearchOptions
    from piper_plan.specs.training import TrainingSpec

    model_name, platform_name, nodes = CASES[case]
    model, platform = with_mtp_layers(load_model(model_name), MTP_LAYERS.get(case)), load_platform(platform_name)
    training = TrainingSpec(seq_len=min(4096, model.max_seq_len or 4096))
    kwargs = search_kwargs(platform, "compact", False)
    result = search(model, platform, training, nodes, SearchOptions(), **kwargs)
    rows = []
    for rank, i in enumerate(result.order[:top], start=1):
        plan, prediction = ranked_plan(model, platform, training, result, int(i), "compact", kwargs["calibration"])
        path = write_plan_file(out / f"{case}_{rank}.json", model, platform, training, nodes, plan, "compact",
                               prediction)
        proc = subprocess.run([str(Path(sys.executable).parent / "piper"), "launch", "--plan", str(path), "--out",
                               str(out / f"job_{case}_{rank}"), "--dry-run"], capture_output=True, text=True, cwd=ROOT)
        error = (proc.stderr.strip().splitlines() or [""])[-1] if proc.returncode else ""
        rows.append({"case": case, "rank": rank, "plan": plan, "model": model, "launch_rc": proc.returncode,
                     "launch_error": error, "step_s": prediction.step_time_s})
    return rows


def layout_key(plan) -> tuple:
    """The shrunk layout of a plan: degrees above 1 -> 2, the rest of the plan kept."""
    two = lambda n: 2 if n > 1 else 1  # noqa: E731
    return (two(plan.pp), two(plan.dp), two(plan.tp), two(plan.ep), plan.schedule, plan.virtual_stages,
            plan.recompute, plan.zero, plan.a2a)


def shrunk_plan_file(key: tuple, model, path: Path) -> Path:
    """plan.json of one shrunk layout on the CPU platform (fp32 training, 2 micro-batches per pipeline stage)."""
    from piper_plan.catalog import load_platform
    from piper_plan.planfile import RuntimeBlock, write_plan_file
    from piper_plan.runtime.model import shrink_spec
    from piper_plan.specs.parallel import ParallelPlan
    from piper_plan.specs.training import TrainingSpec

    pp, dp, tp, ep, schedule, virtual_stages, recompute, zero, a2a = key
    platform = load_platform(SHRUNK_PLATFORM)
    micro = 2 * pp
    plan = ParallelPlan(dp=dp, tp=tp, pp=pp, ep=ep, mbs=1, num_microbatches=micro, schedule=schedule,
                        virtual_stages=virtual_stages, recompute=recompute, zero=zero, a2a=a2a)
    training = TrainingSpec(seq_len=32, global_batch=dp * micro, dtype="fp32", weight_bytes=4, grad_bytes=4,
                            master_bytes=0)
    small = shrink_spec(model, num_layers=4, mtp_layers=None)
    nodes = max(1, plan.world // platform.devices_per_node)
    runtime = RuntimeBlock(steps=STEPS, lr_schedule="constant", warmup_steps=0)
    return write_plan_file(path, small, platform, training, nodes, plan, "compact", None, runtime=runtime)


# ---- training the shrunk layouts (one torchrun per world size) ----------------------------------------
def train_worker(paths: list[str], out_json: str) -> None:
    """Under torchrun: train every plan of this world size for STEPS steps; rank 0 writes the results."""
    import torch.distributed as dist

    from piper_plan.errors import PiperError
    from piper_plan.launchenv import read_launch_env
    from piper_plan.planfile import read_plan_file
    from piper_plan.runtime.mesh import end_process_group
    from piper_plan.runtime.train import Trainer, _init, merge_reports, preflight

    env = read_launch_env()
    dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size)
    results = []
    for path in paths:
        cfg = read_plan_file(path)
        try:
            preflight(cfg, env.world_size, False)
        except PiperError as exc:
            results.append({"path": path, "refused": str(exc)})
            continue
        device = _init(cfg, env.rank, env.world_size, env.local_rank)
        trainer = Trainer(cfg, env.rank, env.world_size, device)
        losses = []
        for step in range(STEPS):
            reports = trainer.gather_reports(trainer.train_step(step), step, stop=False)
            losses.append(merge_reports(reports, step + 1, 0)["loss"])
        results.append({"path": path, "losses": losses})
        del trainer
    if env.rank == 0:
        Path(out_json).write_text(json.dumps(results))
    dist.barrier()
    end_process_group()


def train_layouts(files: dict[tuple, Path], out: Path) -> dict[str, dict]:
    """Every shrunk plan trained; path -> {"losses": [...]} or {"refused": reason} or {"failed": stderr tail}."""
    from piper_plan.planfile import read_plan_file

    by_world: dict[int, list[str]] = {}
    for path in files.values():
        by_world.setdefault(read_plan_file(path).parallel.world, []).append(str(path))
    results: dict[str, dict] = {}
    for world, paths in sorted(by_world.items()):
        out_json = out / f"trained_{world}.json"
        cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", str(world), "--master-port",
               str(_free_port()), str(Path(__file__).resolve()), "--worker", str(out_json), *paths]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1200,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode or not out_json.is_file():
            for p in paths:
                results[p] = {"failed": proc.stderr.strip()[-600:]}
            continue
        results.update({r["path"]: r for r in json.loads(out_json.read_text())})
    return results


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe(plan) -> str:
    return (f"dp{plan.dp} tp{plan.tp} pp{plan.pp} ep{plan.ep} {plan.schedule}"
            f"{'x' + str(plan.virtual_stages) if plan.virtual_stages > 1 else ''} {plan.recompute} z{plan.zero} "
            f"{plan.a2a}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="directory for the plan files (default: a temporary one)")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    ap.add_argument("--no-train", action="store_true", help="launch dry runs only")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        train_worker(args.worker[1:], args.worker[0])
        return 0
    out = Path(args.out or tempfile.mkdtemp(prefix="piper-top-plans-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for case in args.cases.split(",") for r in ranked_plans(case, args.top, out)]
    files: dict[tuple, Path] = {}
    print(f"{'case':9} {'#':>2} {'plan':44} {'step s':>8} {'launch --dry-run':>16}  shrunk layout")
    for r in rows:
        key = layout_key(r["plan"])
        if key not in files:
            files[key] = shrunk_plan_file(key, r["model"], out / f"shrunk_{len(files) + 1}.json")
        launch = "exit 0" if r["launch_rc"] == 0 else f"exit {r['launch_rc']}: {r['launch_error'][:60]}"
        print(f"{r['case']:9} {r['rank']:2d} {describe(r['plan']):44} {r['step_s']:8.2f} {launch:>16}  "
              f"{files[key].stem}")
    failures = sum(r["launch_rc"] != 0 for r in rows)
    if args.no_train:
        return 1 if failures else 0
    trained = train_layouts(files, out)
    print(f"\n{'layout':10} {'plan (shrunk)':44} result")
    for key, path in files.items():
        from piper_plan.planfile import read_plan_file

        r = trained.get(str(path), {"failed": "not run"})
        if "losses" in r:
            text = "trained: losses " + ", ".join(f"{v:.4f}" for v in r["losses"])
        else:
            failures += 1
            text = ("refused: " + r["refused"]) if "refused" in r else ("FAILED: " + r["failed"].splitlines()[-1])
        print(f"{path.stem:10} {describe(read_plan_file(path).parallel):44} {text}")
    print(f"\n{len(rows)} ranked plans, {len(files)} distinct shrunk layouts, {failures} not run")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
