"""zero 0 / 1 gradient reduction overlapped with backward (runtime/grad_sync.py) on 4 gloo ranks: the gradients
equal the blocking reduction after backward (the old path), every bucket's all-reduce is issued inside backward,
and only in the last micro-batch's backward of its parameters (pp = 1 and 1F1B over pp = 2). Whole-model
equality with the single-process reference under the overlapped reduction: tests/runtime/test_mesh_training.py."""

from __future__ import annotations

import pytest
import torch

from plans import plan_dict
from workers import spawn

MICRO = 4
BUCKET_BYTES = 16 * 1024  # tiny-moe: several buckets per gradient group, so that some launch mid-backward
PLANS = {"pp1_dp4_ep2": plan_dict(pp=1, dp=4, ep=2, num_microbatches=MICRO),            # dense dp4, experts edp2
         "pp2_dp2_ep1_1f1b": plan_dict(pp=2, dp=2, ep=1, num_microbatches=MICRO)}       # experts edp2 too


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    jobs = [(k, "overlap", {"plan": p, "bucket_bytes": BUCKET_BYTES}) for k, p in PLANS.items()]
    return spawn(4, jobs, tmp_path_factory.mktemp("overlap"))


@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(PLANS))
def test_overlapped_reduction_equals_blocking_and_runs_inside_backward(results, layout):
    for rank in results:
        over, block = rank[layout]["overlapped"], rank[layout]["blocking"]
        assert block["launches"] == []                      # the old path: nothing issued during backward
        assert over["buckets"] >= 2 and len(over["launches"]) == over["buckets"]
        for launch in over["launches"]:
            assert launch["in_backward"]
            # the hooked parameters' accumulations of the first MICRO - 1 micro-batches all came before
            assert launch["calls"] > over["hooked"] * (MICRO - 1)
        assert over["grads"].keys() == block["grads"].keys()
        for name, grad in over["grads"].items():
            torch.testing.assert_close(grad, block["grads"][name], rtol=1e-5, atol=1e-9, msg=lambda m: f"{name}: {m}")
