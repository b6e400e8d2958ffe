#!/usr/bin/env python
"""Check piper's imported parameter counts against transformers' own count on the meta device.

For every config.json given (default: tests/specs/fixtures/*.json) this builds the model with
``AutoModelForCausalLM.from_config`` under ``torch.device("meta")`` (no weights, no memory), sums
``numel()`` of its parameters (total), and derives the active count from the real module tree: routed
expert tensors (names containing ``.experts.``) count with top_k / num_experts. It prints
"expected N, got N, match" per model and exits 1 on any mismatch. Families transformers does not
implement (deepseek v1, arctic: remote code) and formats piper does not import are reported, not failed.

Needs ``transformers`` (dev only: ``.venv/bin/pip install transformers``); not a piper dependency.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from piper_plan.catalog import read_structured  # noqa: E402
from piper_plan.errors import PiperError  # noqa: E402
from piper_plan.hf_import import spec_from_hf_config  # noqa: E402

NOT_IN_TRANSFORMERS = {"deepseek", "arctic"}
ALIASES = {"kimi_k2": "deepseek_v3"}   # Kimi K2 ships DeepSeek-V3 code under its own model_type


def transformers_config(config: dict):
    """The transformers config object for a raw config dict (llama4 -> its text config)."""
    from transformers import AutoConfig

    data = dict(config)
    model_type = ALIASES.get(data.pop("model_type"), config["model_type"])
    if model_type == "llama4":
        data, model_type = dict(config["text_config"]), "llama4_text"
    for key in ("model_type", "architectures", "_name_or_path", "auto_map"):
        data.pop(key, None)
    return AutoConfig.for_model(model_type, **data)


def meta_counts(config: dict, top_k: int, num_experts: int) -> tuple[int, int]:
    """(total, active) parameter counts of the transformers model built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(transformers_config(config))
    total = routed = 0
    for name, param in model.named_parameters():
        total += param.numel()
        if ".experts." in name and "shared" not in name:
            routed += param.numel()
    assert routed * top_k % max(num_experts, 1) == 0, "routed experts do not split evenly"
    return total, total - routed + routed * top_k // max(num_experts, 1)


def check(path: Path) -> bool | None:
    """True = match, False = mismatch, None = not checkable here."""
    config = read_structured(path)
    try:
        spec = spec_from_hf_config(config, str(path))
    except PiperError as exc:
        print(f"{path.name}: not imported ({exc})")
        return None
    if config.get("model_type") in NOT_IN_TRANSFORMERS:
        print(f"{path.name}: {config['model_type']} is not in transformers; piper counts {spec.total_params:,} / "
              f"{spec.active_params:,} (compare with the hand-derived figures in models.md)")
        return None
    k, e = (spec.moe.top_k, spec.moe.num_experts) if spec.moe else (1, 1)
    try:
        total, active = meta_counts(config, k, e)
    except Exception as exc:  # a config transformers itself cannot build is reported, not counted
        print(f"{path.name}: transformers could not build it ({type(exc).__name__}: {exc})")
        return None
    ok = (total, active) == (spec.total_params, spec.active_params)
    print(f"{path.name}: total expected {total:,}, got {spec.total_params:,}; active expected {active:,}, "
          f"got {spec.active_params:,}: {'match' if ok else 'MISMATCH'}")
    if spec.mtp_layers:    # transformers builds no MTP module: the main model is what is compared
        print(f"  + {spec.mtp_layers} MTP module(s) that transformers does not build: piper counts "
              f"{spec.params.mtp:,} of their own parameters apart (not compared here)")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", type=Path)
    args = parser.parse_args()
    paths = args.configs or sorted((ROOT / "tests" / "specs" / "fixtures").glob("*.json"))
    results = [check(p) for p in paths]
    bad = results.count(False)
    print(f"{results.count(True)} match, {bad} mismatch, {results.count(None)} not checked")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
