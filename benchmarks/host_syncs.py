"""Host synchronisations per MoE layer and micro-batch, counted on CPU, in any checkout of piper.

    .venv/bin/python benchmarks/host_syncs.py [--tree PATH]

Imports ``piper_plan`` from ``--tree`` (default: this checkout; e.g. a ``git worktree`` of an older commit to
get the "before" figure) and counts, with the recorder of tests/runtime/host_syncs.py (this checkout's), every
device-to-host read and data-dependent output shape in one forward and one backward of tiny-moe's MoE layer
(32 tokens) with no expert parallelism and with the flat and HALO dispatchers on a one-rank gloo group. Prints
one line per case: forward and backward totals and the ops behind them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cases(group):
    from piper_plan.runtime.dispatch import FlatDispatcher
    from piper_plan.runtime.halo import HaloDispatcher
    from piper_plan.runtime.topology import RankTopology

    yield "local experts (ep 1)", None, None
    yield "flat dispatcher", FlatDispatcher(group), group
    yield "halo dispatcher", HaloDispatcher([0], RankTopology((0,), (0,), (0,)), 0, group, (None, None)), group


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=str(ROOT), help="checkout whose piper_plan is counted")
    tree = Path(ap.parse_args().tree).resolve()
    sys.path[:0] = [str(tree), str(ROOT / "tests" / "runtime")]
    import subprocess

    import torch
    import torch.distributed as dist

    from host_syncs import count_moe_layer
    from piper_plan.catalog import load_model
    from piper_plan.runtime.mesh import end_process_group
    from piper_plan.runtime.moe import MoE

    commit = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%h %s"], capture_output=True,
                            text=True).stdout.strip()
    print(f"piper_plan from {tree} ({commit[:90]})")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        spec = load_model("tiny-moe")
        for name, dispatcher, group in cases(dist.group.WORLD):
            torch.manual_seed(0)
            moe = MoE(spec.hidden_size, spec.moe, 0, 1, group, dispatcher)
            count_moe_layer(moe, spec.hidden_size)  # warm-up
            fwd, bwd = count_moe_layer(moe, spec.hidden_size)
            print(f"{name}: forward {fwd.total} ({dict(fwd.counts)}), backward {bwd.total} ({dict(bwd.counts)})")
    finally:
        end_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
