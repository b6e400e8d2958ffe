"""Plan dicts for runtime tests (plan.json's format, DESIGN.md) on a CPU platform derived from frontier.yaml."""

from __future__ import annotations

from piper_plan.catalog import load_model, load_platform
from piper_plan.planfile import SCHEMA_VERSION


def cpu_platform(devices_per_node: int = 8) -> dict:
    """frontier.yaml with a CPU/gloo launch section (the runtime's device comes from launch.device), cut to
    ``devices_per_node`` devices so that a plan's world fills its nodes."""
    data = load_platform("frontier").model_dump(mode="json")
    data["name"] = "cpu-test"
    data["launch"] = {**data["launch"], "device": "cpu", "backend": "gloo", "gpus_per_task": 0}
    node = data["node"]
    node["devices_per_node"] = devices_per_node
    node["device_nic"] = [min(n, node["num_nics"] - 1) for n in node["device_nic"][:devices_per_node]]
    for link in node["link_classes"]:
        if link.get("device_pairs"):
            link["device_pairs"] = [pair for pair in link["device_pairs"] if max(pair) < devices_per_node]
    return data


REFERENCE_OPTIMIZER = {"lr_schedule": "constant", "warmup_steps": 0, "weight_decay": 0.0, "grad_clip_norm": None}
"""The runtime settings of tests/runtime/reference.py's single-process AdamW (constant rate, no decay or clipping)."""


def plan_dict(pp=2, dp=2, ep=2, schedule="1f1b", num_microbatches=2, mbs=1, seq_len=16, model="tiny-moe",
              zero=0, steps=3, checkpoint_interval=1000, data=None, model_dict=None, layers_per_stage=None,
              tp=1) -> dict:
    """world = pp x dp x tp; experts regroup a stage's dp x tp ranks as ep x edp."""
    spec = model_dict or load_model(model).model_dump(mode="json")
    parallel = {"dp": dp, "tp": tp, "pp": pp, "ep": ep, "etp": 1, "edp": dp * tp // ep, "mbs": mbs,
                "num_microbatches": num_microbatches, "schedule": schedule, "virtual_stages": 1,
                "recompute": "none", "zero": zero, "a2a": "flat", "layers_per_stage": layers_per_stage}
    training = {"seq_len": seq_len, "global_batch": dp * mbs * num_microbatches, "dtype": "fp32",
                "weight_bytes": 4, "grad_bytes": 4, "master_bytes": 0}
    world = pp * dp * tp
    per_node = min(world, 8)
    return {"schema_version": SCHEMA_VERSION, "piper_version": "test", "model": spec,
            "platform": cpu_platform(per_node), "training": training, "nodes": world // per_node,
            "placement": "compact", "parallel": parallel,
            "moe": {"capacity_factor": None}, "migration": {"enabled": False},
            "runtime": {"data": data, "steps": steps, "checkpoint_interval": checkpoint_interval, "seed": 0,
                        **REFERENCE_OPTIMIZER},
            "prediction": {}}
