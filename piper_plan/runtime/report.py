"""Each rank's step report as one float64 tensor, so that a step's reports travel in one tensor all-gather
(no object pickling each step) and the host reads them once, after the step.

Layout: the fields of ``FIELDS``, then the expert-token counts of every MoE layer of the model (layer order,
E per layer; zero for the layers this rank does not hold; the MTP modules' MoE blocks last). Counts and byte figures are integers below 2^53,
exact in float64. The stop flag (a signal asked the run to stop) and the write_failed flag (rank 0 could not write the
run's records) ride along, so no second collective is needed.
"""

from __future__ import annotations

import math

import torch

from piper_plan.metricsfile import PROCESS_RSS_KEY

FIELDS = ("loss", "mtp_loss", "seconds", "a2a", "p2p", "dp_sync", "parameters_bytes", "gradients_bytes",
          "optimizer_bytes", "activations_bytes", "total_bytes", PROCESS_RSS_KEY, "stage", "dp_index", "stop",
          "write_failed")
_MEMORY = ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "total_bytes")
_TIMES = ("a2a", "p2p", "dp_sync")


_LOSSES = ("loss", "mtp_loss")


def encode(spec, values: dict, losses: dict, expert_tokens: dict, device) -> torch.Tensor:
    """This rank's report: ``values`` holds every field of FIELDS but the losses (host numbers); ``losses`` maps
    "loss" (and "mtp_loss" with MTP modules) to device tensors (none off the last stage); ``expert_tokens`` maps
    layer -> int64 [E] device counters."""
    # the peak RSS is 0 where not measured: GPU ranks report their allocator's peak instead
    head = torch.tensor([math.nan] * len(_LOSSES) + [float(values.get(k, 0) if k == PROCESS_RSS_KEY else values[k])
                                                      for k in FIELDS[len(_LOSSES):]],
                        dtype=torch.float64, device=device)
    for name, value in losses.items():
        head[FIELDS.index(name)] = value.to(torch.float64)
    experts = spec.moe.num_experts if spec.moe else 0
    tokens = torch.zeros(len(spec.expert_layer_ids), experts, dtype=torch.float64, device=device)
    for row, layer in enumerate(spec.expert_layer_ids):
        if layer in expert_tokens:
            tokens[row] = expert_tokens[layer].to(torch.float64)
    return torch.cat([head, tokens.reshape(-1)])


def decode(spec, row: list[float], rank: int, memory_source: str) -> dict:
    """One rank's report dict (train.merge_reports' input) from its gathered row."""
    head = dict(zip(FIELDS, row))
    experts = spec.moe.num_experts if spec.moe else 0
    stage = int(head["stage"])
    tokens = {layer: [int(c) for c in row[len(FIELDS) + i * experts: len(FIELDS) + (i + 1) * experts]]
              for i, layer in enumerate(spec.expert_layer_ids)}
    return {"rank": rank, "stage": stage, "dp_index": int(head["dp_index"]),
            **{k: None if math.isnan(head[k]) else head[k] for k in _LOSSES}, "seconds": head["seconds"],
            "memory": {"stage": stage, **{k: int(head[k]) for k in _MEMORY}, "source": memory_source,
                       **({PROCESS_RSS_KEY: int(head[PROCESS_RSS_KEY])} if head[PROCESS_RSS_KEY] > 0 else {})},
            "time_s": {k: head[k] for k in _TIMES}, "expert_tokens": tokens, "migration": None,
            "stop": bool(head["stop"]), "write_failed": bool(head["write_failed"])}
