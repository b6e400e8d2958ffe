"""Peak host memory of building one rank's pipeline stage, before and after meta-device initialisation
(runtime/model.py ``materialize``), measured on CPU gloo ranks.

before: the stage built on the host with torch's default init, then the seeded ``init_stage`` over the whole stage,
        then split (tp) and sharded (FSDP2, zero 3), as the runtime did before;
after:  the stage built on the meta device, split and sharded there, then ``to_empty`` + the seeded init of this
        rank's part only (what runtime/train.py Trainer does now).

Model: Mixtral 8x7B shrunk (model.shrink_spec: hidden 512, 4 layers, 8 experts of width 2048, vocabulary 32000;
fp32: 537 MB of parameters). Figure per rank: the rise of the process's peak resident set during the build
(``resource.getrusage(RUSAGE_SELF).ru_maxrss`` after the build minus the resident set before it, read from
/proc/self/statm; each method runs in fresh processes) and the bytes of parameters the rank then holds.

Run: .venv/bin/python benchmarks/meta_init_memory.py
"""

from __future__ import annotations

import os
import resource
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "runtime")]  # the test harness's plans and spawner

LAYOUTS = {"world 1 (no split)": dict(world=1, pp=1, dp=1, ep=1, tp=1, zero=0),
           "pp1 dp4 ep2 zero 3": dict(world=4, pp=1, dp=4, ep=2, tp=1, zero=3),
           "pp1 dp2 tp2 ep2 zero 0": dict(world=4, pp=1, dp=2, ep=2, tp=2, zero=0),
           "pp2 dp2 ep2 zero 0": dict(world=4, pp=2, dp=2, ep=2, tp=1, zero=0)}


def model_dict() -> dict:
    from piper_plan.catalog import load_model
    from piper_plan.runtime.model import shrink_spec

    spec = shrink_spec(load_model("mixtral-8x7b"), hidden_size=512, num_layers=4, num_experts=8, vocab_size=32000,
                       ffn_size=4096)
    return spec.model_dump(mode="json")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build(cfg, rank: int, meta: bool):
    """This rank's stage, the old way (host init, then split) or the new one (meta, split, materialize)."""
    import torch

    from piper_plan.runtime.mesh import Mesh
    from piper_plan.runtime.model import build_rank_module, materialize
    from piper_plan.runtime.sharding import shard_stage_module
    from piper_plan.runtime.tensor_parallel import parallelize

    p = cfg.parallel
    mesh = Mesh.create(rank, p.pp, p.dp, p.ep, p.tp, "cpu")
    me = mesh.me
    moe_kwargs = {"ep_rank": me.ep_rank, "ep_size": p.ep, "ep_group": mesh.ep_group, "dispatcher": None,
                  "seq_mesh": mesh.submesh("tp") if p.tp > 1 else None}
    with torch.device("meta") if meta else torch.device("cpu"):
        module = build_rank_module(cfg.model, p, me.pp_index, moe_kwargs, seed=None if meta else 0)
    if p.tp > 1:
        parallelize(module, mesh.submesh("tp"))
    module = shard_stage_module(module, mesh, p, cfg.training.dtype)
    if meta:
        materialize(module, torch.device("cpu"), 0)
    return module


def worker(rank: int, world: int, port: int, jobs: list, out_dir: str) -> None:
    import torch.distributed as dist

    from piper_plan.planfile import parse_plan_dict
    from piper_plan.runtime.accounting import tensor_bytes
    from workers import finish, init

    init(rank, world, port)
    (name, kind, kwargs), = jobs
    cfg = parse_plan_dict(kwargs["plan"], "benchmark plan")
    dist.barrier()
    before = _rss_bytes()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    module = build(cfg, rank, kwargs["meta"])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    from piper_plan.runtime.sharding import local

    held = tensor_bytes(local(q) for q in module.parameters())
    finish({name: {"rise": peak - max(before, peak_before), "held": held}}, rank, out_dir)


def measure(layout: dict, meta: bool) -> list[dict]:
    from plans import plan_dict
    from workers import spawn

    shape = {k: v for k, v in layout.items() if k != "world"}
    plan = plan_dict(num_microbatches=2, model_dict=model_dict(), **shape)
    with tempfile.TemporaryDirectory() as tmp:
        results = spawn(layout["world"], [("build", "build", {"plan": plan, "meta": meta})], Path(tmp), target=worker)
    return [r["build"] for r in results]


def main() -> None:
    print("| layout | rank | parameters held MB | peak RSS rise before (host init) MB | after (meta init) MB |")
    print("|---|---|---|---|---|")
    for label, layout in LAYOUTS.items():
        old, new = measure(layout, meta=False), measure(layout, meta=True)
        for rank, (o, n) in enumerate(zip(old, new)):
            assert o["held"] == n["held"], (label, rank, o["held"], n["held"])
            print(f"| {label} | {rank} | {n['held'] / 1e6:.1f} | {o['rise'] / 1e6:.1f} | {n['rise'] / 1e6:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
