"""What each zero level holds and sends per rank, measured on CPU gloo ranks (docs/design-notes.md "zero 0-3 in
the runtime"): tiny-moe (fp32), 2 micro-batches, 4 ranks, pp1 x dp4 x ep2 (edp 2) and pp2 x dp2 x ep2 (edp 1),
zero 0..3. Per layout and zero level, rank 0 (and the last stage's first rank for pp2): parameters at rest,
peak gathered parameters, peak gradients, optimizer state, peak saved activations (bytes; runtime/accounting.py),
and the data-parallel collectives of one step (count and bytes per rank, by op and group size).

Run: .venv/bin/python benchmarks/zero_memory.py [--dtype fp32|bf16] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "runtime")]  # the test harness's plans and spawned worker

LAYOUTS = {"pp1 dp4 ep2": dict(pp=1, dp=4, ep=2), "pp2 dp2 ep2": dict(pp=2, dp=2, ep=2)}


def plans(dtype: str) -> dict:
    from plans import plan_dict

    out = {}
    for label, shape in LAYOUTS.items():
        for zero in range(4):
            plan = plan_dict(num_microbatches=2, zero=zero, **shape)
            if dtype == "bf16":
                plan["training"].update(dtype="bf16", weight_bytes=2, grad_bytes=2, master_bytes=4)
            out[f"{label} zero{zero}"] = plan
    return out


def rows(results: list[dict], names: list[str]) -> list[str]:
    lines = ["| layout | rank | params at rest | gathered peak | grads peak | optimizer | activations | "
             "collectives per step (op x group: count, bytes/rank) |", "|" + " --- |" * 8]
    for name in names:
        per_rank = [r[name] for r in results]
        shown = [0] + [i for i, r in enumerate(per_rank) if r["stage"] > 0][:1]
        for i in shown:
            r, m = per_rank[i], per_rank[i]["memory"]
            comm = "; ".join(f"{op.replace('_single', '')} x{size}: {n}, {b}" for (op, size), (n, b) in
                             sorted(r["collectives"].items()))
            lines.append(f"| {name} | {i} | {m['parameters_bytes']} | {r['peaks']['gathered']} | "
                         f"{r['peaks']['grads']} | {m['optimizer_bytes']} | {m['activations_bytes']} | {comm} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from fsdp_worker import spawn

    named = plans(args.dtype)
    jobs = [(name, "measure", {"plan": plan}) for name, plan in named.items()]
    with tempfile.TemporaryDirectory() as tmp:
        results = spawn(4, jobs, Path(tmp))
    numel = {name: [r[name]["numel"] for r in results] for name in named}
    print(f"tiny-moe, {args.dtype}, 2 micro-batches; stage numels (rank 0, last stage): "
          f"{numel[next(iter(named))][0]} / pp2: {numel[list(named)[-1]][0]}, {numel[list(named)[-1]][-1]}")
    print("\n".join(rows(results, list(named))))
    if args.json:
        from piper_plan.fileio import atomic_write_json

        atomic_write_json(args.json, {n: [{**r[n], "collectives": {f"{op} x{s}": v for (op, s), v in
                                                                 r[n]["collectives"].items()}} for r in results]
                                      for n in named})


if __name__ == "__main__":
    main()
