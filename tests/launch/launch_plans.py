"""Plan files for the launch tests, in DESIGN.md's plan.json format, written by planfile.plan_file_dict with the
cost model's real prediction (a test may override some of its values); the platforms are the catalog's when
present, else a stand-in built from frontier.yaml whose launch block is the catalog's intended one.
"""

from __future__ import annotations

import json
from pathlib import Path

from piper_plan.catalog import load_model, platforms_dir, read_structured
from piper_plan.specs import ParallelPlan, PlatformSpec, TrainingSpec

STAND_INS = {
    "local-cpu": {"node": {"devices_per_node": 2, "link_classes": [{"name": "shm", "bandwidth_GBps": 5, "source": "test stand-in"}],
                           "num_nics": 1, "nic_bandwidth_GBps": 1, "source": "test stand-in"},
                  "launch": {"template": "local-cpu.sbatch", "backend": "gloo", "device": "cpu", "cpus_per_task": 1,
                             "gpus_per_task": 0, "partition": "cpu", "env": {"OMP_NUM_THREADS": "1"}, "source": "test"}},
    "dgx-h100": {"network_nodes_per_switch": 1,
                 "launch": {"template": "dgx-h100.sbatch", "backend": "nccl", "device": "cuda", "cpus_per_task": 14,
                            "gpus_per_task": 1, "partition": "gpu", "env": {"NCCL_DEBUG": "WARN"}, "source": "test"}},
}


def platform_dict(name: str) -> dict:
    path = platforms_dir() / f"{name}.yaml"
    if path.is_file():
        return read_structured(path)
    data = read_structured(platforms_dir() / "frontier.yaml")
    stand_in = STAND_INS[name]
    data["name"] = name
    data["node"] = stand_in.get("node", data["node"])
    if "network_nodes_per_switch" in stand_in:
        data["network"]["nodes_per_switch"] = stand_in["network_nodes_per_switch"]
    data["launch"] = stand_in["launch"]
    return data


def write_plan(path: Path, platform: str, nodes: int, parallel: dict, *, model: str = "tiny-moe",
               training: dict | None = None, steps: int = 4, prediction: dict | None = None,
               platform_data: dict | None = None) -> Path:
    """Write a plan.json for ``parallel`` (num_microbatches derived: global_batch / (dp x mbs)); ``prediction``
    overrides values of the real estimate (lists element by element; a breakdown or components dict whole)."""
    from piper_plan.cost.evaluate import estimate
    from piper_plan.planfile import RuntimeBlock, plan_file_dict

    plat = PlatformSpec.model_validate(platform_data or platform_dict(platform))
    dp, mbs = parallel.get("dp", 1), parallel.get("mbs", 1)
    training = TrainingSpec.for_device(plat.launch.device, **{"seq_len": 32, "global_batch": 4 * dp * mbs,
                                                             **(training or {})})
    plan = ParallelPlan(**{"num_microbatches": training.global_batch // (dp * mbs), **parallel})
    model_spec = load_model(model)
    est = estimate(model_spec, plat, training, nodes, plan)
    data = plan_file_dict(model_spec, plat, training, nodes, plan, "compact", est,
                          runtime=RuntimeBlock(steps=steps, checkpoint_interval=2))
    data["migration"]["enabled"] = False
    data["prediction"] = _merge(data["prediction"], prediction or {})
    path.write_text(json.dumps(data, indent=2))
    return path


def _merge(base, over):
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: v if k in ("breakdown", "components") else _merge(base.get(k), v)
                           for k, v in over.items()}}
    if isinstance(base, list) and isinstance(over, list):
        return [_merge(b, o) for b, o in zip(base, over)]
    return over
