"""The runtime's own tensor accounting (CPU memory figures of metrics.jsonl; analytic-vs-real tests).

Counts parameters (dense vs routed-expert numel), gradients, optimizer state, and activations saved for
backward, measured with ``torch.autograd.graph.saved_tensors_hooks``: a saved tensor is counted once per
storage while it is alive (parameters saved by matmuls, FSDP2's gathered ones included, are not activations
and are excluded). A DTensor (FSDP2's sharded state) counts its local shard.
"""

from __future__ import annotations

import torch


def param_counts(model: torch.nn.Module) -> dict[str, int]:
    """numel of this rank's parameters: {"dense", "expert", "total"} (expert = routed experts' stacked weights)."""
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in model.parameters())
    return {"dense": total - expert, "expert": expert, "total": total}


def tensor_bytes(tensors) -> int:
    """Bytes this rank holds: a DTensor (FSDP2's sharded state) counts its local shard."""
    from piper_plan.runtime.sharding import local

    return sum(local(t).numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def optimizer_state_bytes(optimizer) -> int:
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard in .optim
    return sum(tensor_bytes(s.values()) for s in inner.state.values())


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter or a view of one: FSDP2's gathered weights (runtime/sharding.py) live in buffers that are
    allocated at each all-gather, so their storage is not among the parameters' at construction."""
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


class _Saved:
    __slots__ = ("tensor", "tracker", "key")

    def __init__(self, tensor, tracker, key):
        self.tensor, self.tracker, self.key = tensor, tracker, key

    def __del__(self):
        self.tracker._release(self.key)


class SavedTensorTracker:
    """Live and peak bytes of tensors autograd saved for backward while the context is active."""

    def __init__(self, model: torch.nn.Module) -> None:
        from piper_plan.runtime.sharding import local

        self.param_ptrs = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.live: dict[int, list[int]] = {}  # storage ptr -> [bytes, references]
        self.live_bytes = self.peak_bytes = self.total_bytes = 0

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.param_ptrs or _is_weight(t) or t.device.type == "meta":
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
