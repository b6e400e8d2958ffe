"""The fp8 recipes' prices against the one published end-to-end pair of them: DeepSeek-V3 on 1,024 H100.

dgx-h100's efficiency.fp8_recipe_time comes from Transformer Engine's GEMM benchmark on H200 NVL (a dense 5B model's
GEMMs, autocast over pre-quantized time; docs/platform-sources.md), not from any training run. NVIDIA's 25.09
performance table ran validation/megatron-bridge-moe.yaml's row 25.09-dsv3-h100 twice: with per-tensor current
scaling (338 model TFLOP/s per GPU, the row's 1,297 tokens/s) and with blockwise scaling, 128 x 128 weights and
1 x 128 activations (330): NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md at df0289c, "25.09 NeMo
Container", DGX-H100, "338 (330)". Same model, so the TFLOP/s ratio is the tokens/s ratio. This prints the row priced
under each recipe and the predicted blockwise / tensorwise ratio beside the published one (a held-out check: nothing
was fitted to it).

Run: .venv/bin/python benchmarks/fp8_recipes.py
"""

from __future__ import annotations

from piper_plan.cost.evaluate import estimate
from piper_plan.validation import _Inputs, load_dataset, row_plan

ROW = "25.09-dsv3-h100"
PUBLISHED_TFLOPS = {"tensorwise": 338.0, "blockwise": 330.0}
"""Megatron-Bridge docs/performance-summary.md at df0289c, 25.09 DGX-H100 DeepSeekV3: '338 (330)'."""


def tokens_per_s_per_gpu(inputs: _Inputs, row, recipe: str) -> float:
    platform, calibration = inputs.platform_of(row)
    training = inputs.training(row).model_copy(update={"fp8_recipe": recipe})
    plan = row_plan(row, training)
    result = estimate(inputs.model(row), platform, training, row.nodes, plan, calibration=calibration,
                      options=inputs.options(row))
    return result.tokens_per_s / plan.world


def main() -> None:
    spec = load_dataset("megatron-bridge-moe")
    inputs = _Inputs(spec)
    (row,) = [r for r in spec.rows if r.id == ROW]
    platform, _ = inputs.platform_of(row)
    factors = platform.efficiency.fp8_recipe_time
    print(f"{ROW} on {platform.name}: linear GEMM time over the fp8 kernel's (efficiency.fp8_recipe_time)")
    priced = {}
    for recipe in ("delayed", "tensorwise", "blockwise"):
        priced[recipe] = tokens_per_s_per_gpu(inputs, row, recipe)
        print(f"  {recipe:10s} x{factors.get(recipe, 1.0):.4f}  {priced[recipe]:8.1f} tokens/s per GPU")
    error = priced["tensorwise"] / row.published - 1
    print(f"published (tensorwise): {row.published:g} tokens/s per GPU; error {error:+.2%}")
    predicted = priced["blockwise"] / priced["tensorwise"]
    published = PUBLISHED_TFLOPS["blockwise"] / PUBLISHED_TFLOPS["tensorwise"]
    print(f"blockwise / tensorwise: predicted {predicted:.4f}, published {published:.4f} "
          f"(330 / 338 TFLOP/s); slowdown predicted {1 - predicted:.2%}, published {1 - published:.2%}")


if __name__ == "__main__":
    main()
