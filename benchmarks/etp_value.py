#!/usr/bin/env python
"""What expert tensor parallelism (etp > 1) buys in piper's own cost model: for each case, the best predicted
step with any etp the search allows vs the best with etp = 1, and how many of the top 10 plans use etp > 1.

The runtime runs etp = 1 only (experts are never tensor-split: capability.py); this measures what dropping etp
from the default search space costs. Prints one row per case; run: ``python benchmarks/etp_value.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from piper_plan.catalog import load_model, load_platform  # noqa: E402
from piper_plan.search.engine import search  # noqa: E402
from piper_plan.search.space import SearchOptions  # noqa: E402
from piper_plan.specs.training import TrainingSpec  # noqa: E402

CASES = [("mixtral-8x7b", "frontier", 8), ("mixtral-8x7b", "frontier", 16), ("mixtral-8x22b", "frontier", 32),
         ("deepseek-v3", "frontier", 128), ("qwen3-235b-a22b", "dgx-h100", 32), ("qwen3-30b-a3b", "dgx-h100", 2),
         ("llama4-scout", "dgx-h100", 8), ("grok-1", "frontier", 64), ("arctic", "frontier", 64)]


def one_case(model_name: str, platform_name: str, nodes: int) -> dict:
    model, platform = load_model(model_name), load_platform(platform_name)
    training = TrainingSpec(seq_len=min(4096, model.max_seq_len or 4096))
    result = search(model, platform, training, nodes, SearchOptions(expert_tp=True))
    order = result.order
    if not len(order):
        return {"case": f"{model_name} / {platform_name} / {nodes}", "best_s": None}
    etp = np.asarray(result.fields["etp"])[order]
    step = np.asarray(result.evaluation.step_time_s)[order]
    plain = step[etp == 1]
    return {"case": f"{model_name} / {platform_name} / {nodes}", "best_s": float(step[0]),
            "best_etp1_s": float(plain[0]) if len(plain) else None, "best_etp": int(etp[0]),
            "top10_etp_gt1": int((etp[:10] > 1).sum()), "feasible": len(order)}


def main() -> None:
    print(f"{'case':42} {'best s':>9} {'best etp=1 s':>13} {'loss':>7} {'etp of #1':>9} {'top-10 etp>1':>12}")
    for case in CASES:
        r = one_case(*case)
        if r["best_s"] is None:
            print(f"{r['case']:42} nothing fits")
            continue
        loss = "n/a" if r["best_etp1_s"] is None else f"{r['best_etp1_s'] / r['best_s'] - 1:+.1%}"
        print(f"{r['case']:42} {r['best_s']:9.2f} {r['best_etp1_s'] or float('nan'):13.2f} {loss:>7} "
              f"{r['best_etp']:9d} {r['top10_etp_gt1']:12d}")


if __name__ == "__main__":
    main()
