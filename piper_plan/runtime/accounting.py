"""The runtime's own tensor accounting (CPU memory figures of metrics.jsonl; analytic-vs-real tests).

Counts parameters (dense vs routed-expert numel), gradients, optimizer state, and activations saved for
backward, measured with ``torch.autograd.graph.saved_tensors_hooks``: a saved tensor is counted once per
storage while it is alive (parameters saved by matmuls are not activations and are excluded).
"""

from __future__ import annotations

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: a DTensor's local shard (tensor_parallel.py), whose buffer may be the result
    of a collective not waited for yet (an AsyncCollectiveTensor: its ``elem``)."""
    t = getattr(t, "_local_tensor", t)
    return getattr(t, "elem", t)


def param_counts(model: torch.nn.Module) -> dict[str, int]:
    """numel of this rank's parameters (its shards of tp-split ones): {"dense", "expert", "total"}
    (expert = routed experts' stacked weights)."""
    expert = sum(_local(p).numel() for n, p in model.named_parameters() if ".experts." in n)
    total = sum(_local(p).numel() for p in model.parameters())
    return {"dense": total - expert, "expert": expert, "total": total}


def tensor_bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (local shards of DTensors)."""
    return sum(_local(t).numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def optimizer_state_bytes(optimizer) -> int:
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard in .optim
    return sum(tensor_bytes(s.values()) for s in inner.state.values())


class _Saved:
    __slots__ = ("tensor", "tracker", "key")

    def __init__(self, tensor, tracker, key):
        self.tensor, self.tracker, self.key = tensor, tracker, key

    def __del__(self):
        self.tracker._release(self.key)


class SavedTensorTracker:
    """Live and peak bytes of tensors autograd saved for backward while the context is active."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.param_ptrs = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.live: dict[int, list[int]] = {}  # storage ptr -> [bytes, references]
        self.live_bytes = self.peak_bytes = self.total_bytes = 0

    def _pack(self, t: torch.Tensor):
        storage = _local(t).untyped_storage()   # a DTensor autograd saved: its local shard
        key = storage.data_ptr()
        if key in self.param_ptrs or t.device.type == "meta":
            return t
        entry = self.live.setdefault(key, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.live_bytes += entry[0]
            self.total_bytes += entry[0]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        entry[1] += 1
        # detached: a tensor saved by the op that made it would otherwise hold its own grad_fn (a cycle that
        # is never collected when backward does not reach that node, e.g. router probabilities without aux loss)
        return _Saved(t.detach(), self, key)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live_bytes -= entry[0]
            del self.live[key]

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self.total_bytes = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
