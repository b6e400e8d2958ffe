"""Data-parallel gradient reduction for zero 0 / 1 (parameters FSDP2 does not manage), overlapped with backward.

Each gradient group (dense weights over dp, routed experts over edp) is cut into buckets of at most
``BUCKET_BYTES`` in reverse parameter order (roughly the order backward produces gradients, as torch DDP's
reducer). A ``register_post_accumulate_grad_hook`` counts each parameter's gradient accumulations; once every
parameter of a bucket has had its last one of the step (one per micro-batch: ``num_microbatches``, so under
pipelining only the last micro-batch's backward of that parameter launches it), the bucket is all-reduced
asynchronously from its own buffer while backward goes on. Each parameter's gradient is copied at its own last
accumulation (the buffer is their concatenation), not when the bucket is complete: the interleaved schedule
scales a model chunk's gradients (``scale_grads``) right after that chunk's last backward, which can come before
the other chunk's parameters of the same bucket are done. ``finish`` (after the schedule's step) waits for the
reductions and writes ``sum / (divisor x num_microbatches)`` back: the micro-batch mean is folded in there because
every copy was taken before ``scale_grads`` divided the local gradients, which the write-back replaces. A bucket
whose hooks did not all fire (a parameter without a gradient this step) is reduced in ``finish`` as before: zeros
for missing gradients, the local gradients already scaled. Groups of one rank are only divided.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from piper_plan.runtime.tensor_parallel import local_tensor

BUCKET_BYTES = 25 * 2**20
"""Bucket size: torch DDP's default ``bucket_cap_mb=25`` (torch.nn.parallel.DistributedDataParallel)."""


def allreduce_mean(params, group, divisor: int, bucket_numel: int = 2**25) -> None:
    """Sum gradients over ``group`` (None: no communication) in flat buckets, then divide by ``divisor``
    (blocking; missing gradients count as zeros)."""
    for q in params:
        if q.grad is None:
            q.grad = torch.zeros_like(q)
    for bucket in buckets([local_tensor(q.grad) for q in params], bucket_numel):
        flat = _flatten_dense_tensors(bucket)
        if group is not None:
            dist.all_reduce(flat, group=group)
        flat /= divisor
        for g, s in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(s)


def buckets(tensors, bucket_numel: int):
    """Consecutive runs of ``tensors`` of at most ``bucket_numel`` elements (a larger tensor alone)."""
    bucket, size = [], 0
    for t in tensors:
        if bucket and size + t.numel() > bucket_numel:
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel()
    if bucket:
        yield bucket


class _Bucket:
    def __init__(self, params: list, group, divisor: int) -> None:
        self.params, self.group, self.divisor = params, group, divisor
        self.work = self.flat = self.grads = None
        self.copies: dict[int, torch.Tensor] = {}
        """Each parameter's local gradient as it was at its last accumulation of the step (flattened)."""

    def copy_in(self, param) -> None:
        """Keep the parameter's gradient as it is now (its last accumulation): the schedule may scale it before
        the bucket's other parameters are done."""
        self.copies[id(param)] = local_tensor(param.grad).reshape(-1).clone()


class OverlappedReducer:
    """The bucketed, backward-overlapped all-reduce of one or more gradient groups (module docstring)."""

    def __init__(self, groups: list[tuple[list, object, int]], num_microbatches: int,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        """groups: (parameters, process group, divisor) per gradient group; a group of one rank: None (then
        only divided; nothing at all where the divisor is 1 too)."""
        self.num_microbatches = num_microbatches
        self.armed = False
        self.launches: list[dict] = []
        """This step's launched buckets: parameters, hook calls seen so far, whether inside backward (tests)."""
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        self._count: dict[int, int] = {}
        self._calls = 0
        self._handles = []
        for params, group, divisor in groups:
            self._add_group(params, group, divisor, bucket_bytes)

    def _add_group(self, params: list, group, divisor: int, bucket_bytes: int) -> None:
        if group is None and divisor == 1:
            return
        ordered = list(reversed(params))
        numel = max(1, bucket_bytes // max((q.element_size() for q in ordered), default=4))
        for members in buckets(ordered, numel):            # a DTensor counts its global size: a heuristic only
            bucket = _Bucket(members, group, divisor)
            self._buckets.append(bucket)
            if group is None:
                continue                                   # nothing to overlap: divided in finish
            for q in bucket.params:
                self._bucket_of[id(q)] = bucket
                self._handles.append(q.register_post_accumulate_grad_hook(self._on_grad))

    @property
    def hooked_params(self) -> int:
        """Parameters whose reduction is overlapped (in a group of more than one rank)."""
        return len(self._bucket_of)

    @property
    def overlapped_buckets(self) -> int:
        return sum(b.group is not None for b in self._buckets)

    def arm(self) -> None:
        """Start a step: count accumulations from zero and launch buckets as they complete."""
        self._count = {k: 0 for k in self._bucket_of}
        self._calls, self.launches, self.armed = 0, [], True

    def _on_grad(self, param) -> None:
        if not self.armed:
            return
        self._calls += 1
        key = id(param)
        self._count[key] += 1
        assert self._count[key] <= self.num_microbatches, "a gradient accumulated after its bucket's reduction began"
        bucket = self._bucket_of[key]
        if self._count[key] < self.num_microbatches:
            return
        bucket.copy_in(param)
        if bucket.work is None and all(self._count[id(q)] == self.num_microbatches for q in bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.grads = [local_tensor(q.grad) for q in bucket.params]
        bucket.flat = torch.cat([bucket.copies.pop(id(q)) for q in bucket.params])
        bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)
        self.launches.append({"params": len(bucket.params), "calls": self._calls,
                              "in_backward": torch._C._current_graph_task_id() != -1})

    def finish(self) -> None:
        """Wait for the launched reductions and write them back; reduce the rest now (module docstring)."""
        self.armed = False
        for bucket in self._buckets:
            if bucket.work is None:
                bucket.copies.clear()                      # a bucket some of whose hooks did not fire this step
                allreduce_mean(bucket.params, bucket.group, bucket.divisor)
                continue
            bucket.work.wait()
            bucket.flat /= bucket.divisor * self.num_microbatches
            for g, s in zip(bucket.grads, _unflatten_dense_tensors(bucket.flat, bucket.grads)):
                g.copy_(s)                                 # the local gradient tensor itself (a view of a DTensor's)
            bucket.work = bucket.flat = bucket.grads = None

    def remove(self) -> None:
        """Unregister the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
