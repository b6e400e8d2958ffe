"""Plan files for the launch tests, in DESIGN.md's plan.json format (schema_version 1).

Written with piper_plan.planfile.write_plan_file when it exists (the cost engineer's writer); the platforms are
the catalog's when present, else a stand-in built from frontier.yaml whose launch block is the catalog's
intended one (only until platforms/<name>.yaml lands).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from piper_plan.catalog import load_model, platforms_dir
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
        return yaml.safe_load(path.read_text())
    data = yaml.safe_load((platforms_dir() / "frontier.yaml").read_text())
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
    """Write a plan.json for ``parallel`` (num_microbatches derived: global_batch / (dp x mbs))."""
    plat = PlatformSpec.model_validate(platform_data or platform_dict(platform))
    dp, mbs = parallel.get("dp", 1), parallel.get("mbs", 1)
    training = TrainingSpec(**{"seq_len": 32, "global_batch": 4 * dp * mbs, "dtype": "fp32", **(training or {})})
    plan = ParallelPlan(**{"num_microbatches": training.global_batch // (dp * mbs), **parallel})
    model_spec = load_model(model)
    data = {"schema_version": 1, "piper_version": "test",
            "model": model_spec.model_dump(mode="json"), "platform": plat.model_dump(mode="json"),
            "training": training.model_dump(mode="json"), "nodes": nodes, "placement": "compact",
            "parallel": {**plan.model_dump(mode="json"), "edp": plan.edp},
            "moe": {"capacity_factor": None, "routing_skew": 1.0},
            "migration": {"enabled": False, "threshold": 1.1, "interval": 50, "max_iters": 16},
            "runtime": {"data": None, "steps": steps, "checkpoint_interval": 2, "seed": 0},
            "prediction": prediction or {"step_time_s": 3.0, "tokens_per_s": 1000.0}}
    path.write_text(json.dumps(data, indent=2))
    return path
