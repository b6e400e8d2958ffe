"""Fit a platform's host constant (efficiency.host_s_per_gemm_call, cost/overhead.py's host floor) on one row.

validation/megatron-bridge-moe.yaml marks one row per hardware type `split: fit` (the rule that chose it is in the
dataset's header); this finds, by bisection, the seconds per GEMM call at which that row's predicted tokens/s per
GPU equals the published one, with the row's own platform, options and plan. It prints the value to write into
the platform file; every other row of the dataset stays held out. Rows that are not host-bound at any value
print that no value reaches the published number.

With --rule it prints, for every row, the quantity the fit rows were chosen by (before the floor existed): host
GEMM calls of one MoE layer per millisecond of its device time (3 x linears outside CUDA graphs / the device time
per layer and micro-batch of the busiest stage, host constant 0).

With --instead ROW it fits the constant on ROW (a row that is not its platform's fit row: for the record, never
written to a platform) and prints every other row of that platform as priced with it.

Run: .venv/bin/python benchmarks/fit_host_floor.py 25.11-qwen3-30b-h100 25.11-qwen3-235b-b200 25.11-qwen3-30b-gb200
     .venv/bin/python benchmarks/fit_host_floor.py --rule
     .venv/bin/python benchmarks/fit_host_floor.py --instead 25.09-qwen3-30b-h100-drop
"""

from __future__ import annotations

import sys

from piper_plan.calibration.fit import apply
from piper_plan.cost.overhead import GEMMS_PER_LINEAR, linears_per_layer
from piper_plan.validation import _Inputs, load_dataset, row_plan

DATASET = "megatron-bridge-moe"
UPPER_S = 1e-3            # bisection bracket: 0 .. 1 ms per GEMM call
STEPS = 60


def _estimate(inputs: _Inputs, row, seconds: float):
    """The row's estimate with its platform's host constant set to ``seconds`` (calibration.fit.apply)."""
    from piper_plan.cost.evaluate import estimate

    model, training = inputs.model(row), inputs.training(row)
    platform, calibration = inputs.platform_of(row)
    options, platform = apply(platform, inputs.options(row), {"efficiency.host_s_per_gemm_call": seconds})
    return estimate(model, platform, training, row.nodes, row_plan(row, training), calibration=calibration,
                    options=options)


def predicted_at(inputs: _Inputs, row, seconds: float) -> float:
    """The row's predicted tokens/s per GPU at ``seconds`` per GEMM call."""
    return _estimate(inputs, row, seconds).tokens_per_s / row_plan(row, inputs.training(row)).world


def fit_row(inputs: _Inputs, row) -> float | None:
    """Seconds per GEMM call at which the row meets its published number (predictions fall as it grows)."""
    if predicted_at(inputs, row, UPPER_S) > row.published or predicted_at(inputs, row, 0.0) < row.published:
        return None
    low, high = 0.0, UPPER_S
    for _ in range(STEPS):
        mid = (low + high) / 2
        low, high = (mid, high) if predicted_at(inputs, row, mid) > row.published else (low, mid)
    return (low + high) / 2


def host_calls_per_device_ms(inputs: _Inputs, row) -> float:
    """The fit-row rule's quantity for ``row``, priced without any host time."""
    model, plan, options = inputs.model(row), row_plan(row, inputs.training(row)), inputs.options(row)
    busiest = max(_estimate(inputs, row, 0.0).memory.per_stage, key=lambda s: s.time_per_microbatch_s)
    device_ms = 1e3 * busiest.time_per_microbatch_s / busiest.layers
    _, moe_linears = linears_per_layer(model, model.moe.num_experts / plan.ep, options.cuda_graph_scope)
    return GEMMS_PER_LINEAR * float(moe_linears) / device_ms


def main(row_ids: list[str]) -> None:
    spec = load_dataset(DATASET)
    inputs = _Inputs(spec)
    rows = {r.id: r for r in spec.rows}
    if row_ids == ["--rule"]:
        for row in spec.rows:
            platform, _ = inputs.platform_of(row)
            rate = host_calls_per_device_ms(inputs, row)
            print(f"{row.id:28s} {platform.name:12s} host calls per device-ms {rate:6.2f}")
        return
    instead = row_ids[:1] == ["--instead"]
    row_ids = row_ids[1:] if instead else row_ids
    unknown = [r for r in row_ids if r not in rows]
    if unknown:
        print(f"error: fit_host_floor.py: row {unknown[0]!r} is not in validation/{DATASET}.yaml; rows: "
              + ", ".join(rows), file=sys.stderr)
        sys.exit(2)
    for row_id in row_ids:
        row = rows[row_id]
        platform, _ = inputs.platform_of(row)
        seconds = fit_row(inputs, row)
        value = "no value in 0 .. 1 ms reaches the published number" if seconds is None else f"{seconds * 1e6:.1f} us"
        print(f"{row_id} ({row.split or 'held_out'}): {platform.name} efficiency.host_s_per_gemm_call = {value}")
        if instead and seconds is not None:
            _print_priced_with(inputs, spec.rows, row, platform.name, seconds)


def _print_priced_with(inputs: _Inputs, rows, fitted, platform_name: str, seconds: float) -> None:
    """Every other row of ``platform_name``, priced with the constant fitted on ``fitted``."""
    for row in rows:
        if row.id != fitted.id and inputs.platform_of(row)[0].name == platform_name:
            predicted = predicted_at(inputs, row, seconds)
            print(f"  {row.id:28s} published {row.published:8.0f}  predicted {predicted:8.0f}  "
                  f"error {100 * (predicted / row.published - 1):+.2f}%")


if __name__ == "__main__":
    main(sys.argv[1:])
