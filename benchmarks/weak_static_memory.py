"""Static memory per GPU of the Piper paper's weak-scaling family: piper's resource model vs the paper's formula
(L/PP)(64 d^2 + 32 E/EP d d_ffn) with the family's 2-matrix experts (the paper writes 48 for 3-matrix ones).

Run: .venv/bin/python benchmarks/weak_static_memory.py   (prints a Markdown table; tests/cost/test_published.py
asserts the same equality).
"""

from piper_plan.catalog import load_model, load_platform
from piper_plan.cost.evaluate import estimate
from piper_plan.specs import ParallelPlan, TrainingSpec

CASES = [("piper-weak-110b", 8, 8, 8), ("piper-weak-862b", 64, 32, 16), ("piper-weak-1.7t", 128, 32, 32)]


def main() -> None:
    print("| model | GCDs | PP x EP | piper static GB (stage 0) | paper formula GB | difference |")
    print("|---|---:|---|---:|---:|---:|")
    for name, nodes, ep, pp in CASES:
        model = load_model(name)
        plan = ParallelPlan(dp=ep, pp=pp, ep=ep, num_microbatches=8)
        stage = estimate(model, load_platform("frontier"), TrainingSpec(global_batch=ep * 8), nodes,
                         plan).memory.per_stage[0]
        c = stage.components
        ours = c["weights"] + c["gradients"] + c["optimizer"]
        d, moe = model.hidden_size, model.moe
        paper = stage.layers * (64 * d * d + 32 * moe.num_experts / ep * d * moe.expert.intermediate_size)
        print(f"| {name} | {nodes * 8} | {pp} x {ep} | {ours / 1e9:.3f} | {paper / 1e9:.3f} | "
              f"{100 * (ours - paper) / paper:+.3f}% (router + norms) |")


if __name__ == "__main__":
    main()
