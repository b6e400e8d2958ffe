"""The runtime's own tensor accounting (CPU memory figures of metrics.jsonl; analytic-vs-real tests).

Counts parameters (dense vs routed-expert numel), gradients, optimizer state, and activations saved for
backward, measured with ``torch.autograd.graph.saved_tensors_hooks``: a saved tensor is counted once per
storage while it is alive (parameters saved by matmuls, FSDP2's gathered ones included, are not activations
and are excluded). A DTensor (FSDP2's sharded state) counts its local shard.
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
        self.param_ptrs = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.live: dict[int, list[int]] = {}  # storage ptr -> [bytes, references]
        self.live_bytes = self.peak_bytes = self.total_bytes = 0
        self.on_sample = None
        """Optional callable run at every pack and unpack (StatePeaks.sample: a dense sampling of forward and
        backward)."""

    def _pack(self, t: torch.Tensor):
        storage = _local(t).untyped_storage()   # a DTensor autograd saved: its local shard
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
        if self.on_sample is not None:
            self.on_sample()
        return _Saved(t.detach(), self, key)

    def _unpack(self, saved):
        if self.on_sample is not None:
            self.on_sample()
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


# ---- measurement only: the state FSDP2 holds while a step runs -----------------------------------------
def _fsdp_params(module: torch.nn.Module) -> list:
    """Every FSDPParam of the FSDP2 groups under ``module`` (torch 2.13's private per-module state)."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in module.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            out += list(group.fsdp_params) if group is not None else []
    return out


def fsdp_live_bytes(module: torch.nn.Module) -> dict[str, int]:
    """Bytes FSDP2 holds now beside the sharded parameters: ``gathered`` (unsharded compute copies of parameters,
    in param dtype), ``unsharded_grads`` (gradients of those copies, incl. a no-sync accumulator), ``sharded_grads``
    (the local shards of the reduced gradients). Reads FSDP2's private state: a measurement, not runtime logic."""
    gathered = unsharded = sharded = 0
    for fp in _fsdp_params(module):
        full = getattr(fp, "_unsharded_param", None)
        gathered += sum(t.untyped_storage().nbytes() for t in getattr(fp, "all_gather_outputs", []))  # 0 when freed
        if full is not None and full.grad is not None:
            unsharded += full.grad.numel() * full.grad.element_size()
        acc = getattr(fp, "unsharded_accumulated_grad", None)
        if acc is not None:
            unsharded += acc.numel() * acc.element_size()
        sharded += tensor_bytes([fp.sharded_param.grad])
    return {"gathered": gathered, "unsharded_grads": unsharded, "sharded_grads": sharded}


class StatePeaks:
    """Peaks over a step of what fsdp_live_bytes counts and of the gradients of the parameters FSDP2 does not
    manage, sampled at every saved-tensor pack / unpack (SavedTensorTracker.on_sample) and whenever called."""

    def __init__(self, module: torch.nn.Module, params: list) -> None:
        from piper_plan.runtime.sharding import replicated

        self.module, self.plain = module, replicated(params)
        self.peak = {"gathered": 0, "grads": 0}

    def sample(self) -> None:
        live = fsdp_live_bytes(self.module)
        grads = live["unsharded_grads"] + live["sharded_grads"] + tensor_bytes(q.grad for q in self.plain)
        self.peak["gathered"] = max(self.peak["gathered"], live["gathered"])
        self.peak["grads"] = max(self.peak["grads"], grads)


class CollectiveCounter:
    """Counts the data-parallel collectives of a step by wrapping torch.distributed's all_gather_single (FSDP2's
    all-gather), reduce_scatter_single (its reduce-scatter), all_reduce (zero 0's buckets) and broadcast
    (ZeroRedundancyOptimizer's parameter broadcast): ``calls[(op, group size)] = [count, bytes per rank]``, bytes
    = the collective's input on this rank (all-gather: the local shard; reduce-scatter: the unsharded input).
    Tensors of at most ``min_bytes`` (scalars: loss mean, gradient norm) are left out. Measurement only."""

    OPS = ("all_gather_single", "reduce_scatter_single", "all_reduce", "broadcast")

    def __init__(self, min_bytes: int = 64) -> None:
        self.min_bytes, self.calls, self._orig = min_bytes, {}, {}

    def __enter__(self):
        import torch.distributed as dist

        for op in self.OPS:
            self._orig[op] = getattr(dist, op)
            setattr(dist, op, self._wrap(op, self._orig[op]))
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for op, fn in self._orig.items():
            setattr(dist, op, fn)
        return False

    def _wrap(self, op: str, fn):
        import torch.distributed as dist

        def counted(*args, **kwargs):
            tensor = kwargs.get("input", kwargs.get("input_tensor", kwargs.get("tensor")))
            if tensor is None:
                tensor = args[1] if op in ("all_gather_single", "reduce_scatter_single") else args[0]
            group = kwargs.get("group")
            size = dist.get_world_size(group)
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes > self.min_bytes:
                entry = self.calls.setdefault((op, size), [0, 0])
                entry[0] += 1
                entry[1] += nbytes
            return fn(*args, **kwargs)

        return counted
