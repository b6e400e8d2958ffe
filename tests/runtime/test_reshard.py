"""Resharding checkpoints (runtime/checkpoint.py, torch.distributed.checkpoint): 4 steps on layout A with a
checkpoint at step 2, resumed on layout B from step 2: steps 3-4 equal the uninterrupted run on A. Layouts change
pp (2 -> 1, interleaved -> 1), dp / ep (dp4 ep4 -> pp2 dp2 ep2, dp4 ep4 -> dp2 ep2 on fewer ranks), ZeRO-1 ->
none, world 2 -> 1, pp2 -> tp2, FSDP2 (zero 3) <-> other layouts, ZeRO-1 over tp shards (tp2 x dp2 zero 1) <->
pp2 and zero 3, and one run migrates experts before its checkpoint (slots permuted when saved). Bad
checkpoints give one PiperError on every rank and change nothing. One spawn per world size (4, then 2)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from piper_plan.catalog import load_model
from piper_plan.rundir import first_difference
from piper_plan.runtime.checkpoint import doomed, expert_key, held_experts, layout_free_name
from plans import plan_dict
from reshard_worker import worker
from workers import spawn

RTOL = 1e-5  # other layouts sum in another order; the same layout is exact

MIGRATION = {"enabled": True, "threshold": 1.0, "interval": 2, "max_iters": 4}
# global batch 4 on every layout (dp x mbs x micro-batches), so every layout trains on the same tokens
PLANS = {
    "pp2_dp2_ep2_migrating": {**plan_dict(pp=2, dp=2, ep=2, schedule="gpipe", num_microbatches=2),
                              "migration": MIGRATION},
    "pp1_dp4_ep4_zero1": plan_dict(pp=1, dp=4, ep=4, num_microbatches=1, zero=1),
    "pp2_dp2_ep2": plan_dict(pp=2, dp=2, ep=2, schedule="1f1b", num_microbatches=2),
    "pp2_dp1_ep1": plan_dict(pp=2, dp=1, ep=1, num_microbatches=4),
    "pp1_dp2_ep2": plan_dict(pp=1, dp=2, ep=2, num_microbatches=2),
    "pp1_dp1_ep1": plan_dict(pp=1, dp=1, ep=1, num_microbatches=4),
}
INTERLEAVED = plan_dict(pp=2, dp=1, ep=1, schedule="interleaved", num_microbatches=4)
INTERLEAVED["parallel"]["virtual_stages"] = 2  # chunks.<v>. prefixes in the module's FQNs
PLANS["pp2_v2_dp1_ep1"] = INTERLEAVED
PLANS["pp1_dp2_ep2_zero3"] = plan_dict(pp=1, dp=2, ep=2, num_microbatches=2, zero=3)   # FSDP2: DTensor state
PLANS["pp1_tp2"] = plan_dict(pp=1, dp=1, ep=1, tp=2, num_microbatches=4)               # tensor parallel
PLANS["pp1_dp2_tp2_zero1"] = plan_dict(pp=1, dp=2, ep=2, tp=2, num_microbatches=2, zero=1)  # ZeRO over tp shards
PLANS["pp1_dp4_ep4_zero3"] = plan_dict(pp=1, dp=4, ep=4, num_microbatches=1, zero=3)
PLANS["pp1_dp4_ep4_zero3_hsdp2"] = plan_dict(pp=1, dp=4, ep=4, num_microbatches=1, zero=3)
PLANS["pp1_dp4_ep4_zero3_hsdp2"]["parallel"]["dp_replicate"] = 2                       # HSDP: 2-D DTensor state
# (A, B, world of A, world of B)
CASES = {
    "migrated_pp2_dp2_ep2_to_pp1_dp4_ep4": ("pp2_dp2_ep2_migrating", "pp1_dp4_ep4_zero1", 4, 4),
    "dp4_ep4_zero1_to_pp2_dp2_ep2": ("pp1_dp4_ep4_zero1", "pp2_dp2_ep2", 4, 4),
    "dp4_ep4_to_dp2_ep2_on_2_ranks": ("pp1_dp4_ep4_zero1", "pp1_dp2_ep2", 4, 2),
    "pp2_to_pp1_dp2_ep2": ("pp2_dp1_ep1", "pp1_dp2_ep2", 2, 2),
    "interleaved_to_pp1_dp2_ep2": ("pp2_v2_dp1_ep1", "pp1_dp2_ep2", 2, 2),
    "same_layout_pp2": ("pp2_dp1_ep1", "pp2_dp1_ep1", 2, 2),
    "pp2_to_tp2": ("pp2_dp1_ep1", "pp1_tp2", 2, 2),
    "zero3_to_pp2": ("pp1_dp2_ep2_zero3", "pp2_dp1_ep1", 2, 2),
    "tp2_to_zero3": ("pp1_tp2", "pp1_dp2_ep2_zero3", 2, 2),
    "tp2_dp2_zero1_to_pp2_dp2_ep2": ("pp1_dp2_tp2_zero1", "pp2_dp2_ep2", 4, 4),
    "zero3_to_tp2_dp2_zero1": ("pp1_dp4_ep4_zero3", "pp1_dp2_tp2_zero1", 4, 4),
    "same_layout_tp2_dp2_zero1": ("pp1_dp2_tp2_zero1", "pp1_dp2_tp2_zero1", 4, 4),
    "hsdp_to_pp2_dp2_ep2": ("pp1_dp4_ep4_zero3_hsdp2", "pp2_dp2_ep2", 4, 4),
}


def _other_model_plan() -> dict:
    spec = load_model("tiny-moe").model_dump(mode="json")
    spec["moe"]["num_experts"] = 4
    return plan_dict(pp=2, dp=1, ep=1, num_microbatches=4, model_dict=spec)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reshard")
    out = {}
    for world in (4, 2):
        trains = sorted({a for a, _, wa, _ in CASES.values() if wa == world})
        jobs = [(f"train:{a}", "train", {"plan": PLANS[a], "run_dir": str(tmp / a)}) for a in trains]
        jobs += [(f"resume:{case}", "resume", {"plan": PLANS[b], "run_dir": str(tmp / a)})
                 for case, (a, b, _, wb) in CASES.items() if wb == world]
        if world == 2:
            jobs += _bad_jobs(tmp / "pp2_dp1_ep1")
        (tmp / f"world{world}").mkdir()
        results = spawn(world, jobs, tmp / f"world{world}", target=worker)
        for name, _, _ in jobs:
            out[name] = [r[name] for r in results]
    out["tmp"] = tmp
    return out


def _tied_plan(pp: int, dp: int) -> dict:
    spec = load_model("tiny-moe").model_dump(mode="json")
    spec["tie_embeddings"] = True  # pp > 1: the last stage has its own LM head; pp = 1: the head is the embedding
    return plan_dict(pp=pp, dp=dp, ep=dp, num_microbatches=4 // dp, model_dict=spec)


def _bad_jobs(run_dir) -> list:
    plan = PLANS["pp2_dp1_ep1"]
    tied = str(run_dir) + "_tied"
    return [("train:tied", "train", {"plan": _tied_plan(2, 1), "run_dir": tied, "steps": 2}),
            ("bad:tied_head", "bad_resume", {"plan": _tied_plan(1, 2), "run_dir": tied}),
            ("bad_copies", "bad_copies", {"run_dir": str(run_dir)}),
            ("bad:other_model", "bad_resume", {"plan": _other_model_plan(), "run_dir": str(run_dir)}),
            ("bad:missing_shard", "bad_resume", {"plan": plan, "run_dir": f"{run_dir}_missing_shard"}),
            ("bad:short_shard", "bad_resume", {"plan": plan, "run_dir": f"{run_dir}_short_shard"}),
            ("dcp_error", "dcp_error", {"run_dir": str(run_dir)}),
            ("failed_save", "failed_save", {"plan": plan, "run_dir": f"{run_dir}_failed_save"})]


def _losses(per_rank: list[dict]) -> list[list[float]]:
    """The losses of the ranks that report one (the last stage's dp ranks): one list per such rank."""
    return [r["losses"] for r in per_rank if r["losses"] and r["losses"][0] is not None]


# ---- pure parts --------------------------------------------------------------------------------------------
def test_layout_free_names():
    assert layout_free_name("chunks.1.layers.3.attn.q.weight") == "layers.3.attn.q.weight"
    assert layout_free_name("layers.3.attn.q.weight") == "layers.3.attn.q.weight"
    assert expert_key("layers.3.mlp.experts.w_in", 5) == "layers.3.mlp.experts.5.w_in"
    # EP rank 1 of 2 (slots 4-7) after a migration that put expert 0 in slot 6 and expert 6 in slot 0
    assert held_experts([6, 1, 2, 3, 4, 5, 0, 7], 4, 4) == [(0, 2), (4, 0), (5, 1), (7, 3)]


def test_rotation_keeps_the_newest_up_to_latest_and_drops_leftovers():
    names = ["latest", "step_2", "step_4", "step_6", "step_8.tmp", "step_6.old", "step_10"]
    assert sorted(doomed(names, latest=6, keep=2)) == ["step_10", "step_2", "step_6.old", "step_8.tmp"]
    assert sorted(doomed(names, latest=6, keep=1)) == ["step_10", "step_2", "step_4", "step_6.old", "step_8.tmp"]


def test_first_difference_names_the_field():
    assert first_difference({"a": 1, "b": {"c": [1, 2]}}, {"a": 1, "b": {"c": [1, 3]}}) == "b.c[1]: 2 (checkpoint) vs 3 (plan)"
    assert first_difference({"a": 1}, {"a": 1}) is None


# ---- multi-process -------------------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_under_another_layout_repeats_steps_3_and_4(runs, case):
    a, b, _, _ = CASES[case]
    want = _losses(runs[f"train:{a}"])
    got = _losses(runs[f"resume:{case}"])
    assert want and got
    assert all(r["start"] == 2 for r in runs[f"resume:{case}"])
    for losses in got:
        if a == b:
            assert losses == want[0][2:]  # exact
        else:
            assert losses == pytest.approx(want[0][2:], rel=RTOL)


@pytest.mark.distributed
def test_migrated_slots_were_saved_and_resume_under_another_ep_gets_the_identity(runs):
    a, _, _, _ = CASES["migrated_pp2_dp2_ep2_to_pp1_dp4_ep4"]
    saved = [r["slots"] for r in runs[f"train:{a}"]]
    assert any(row != list(range(8)) for s in saved for row in s.values())  # permuted when saved
    resumed = runs["resume:migrated_pp2_dp2_ep2_to_pp1_dp4_ep4"]
    assert all(row == list(range(8)) for r in resumed for row in r["slots"].values())
    meta = json.loads((runs["tmp"] / a / "checkpoints" / "step_2" / "piper.json").read_text())
    assert {int(k) for k in meta["slot_of_expert"]} == {0, 1, 2, 3}  # both stages' layers
    assert meta["slot_of_expert"] == {str(k): v for s in saved for k, v in s.items()}


@pytest.mark.distributed
def test_checkpoint_layout_on_disk(runs):
    root = runs["tmp"] / "pp2_dp1_ep1" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2"]
    assert sorted(p.name for p in (root / "step_2").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                   "piper.json"]
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(str(root / "step_2")).read_metadata().state_dict_metadata)
    assert "model.layers.3.mlp.experts.7.w_in" in keys and "optim.layers.3.mlp.experts.7.w_in.exp_avg_sq" in keys
    assert {"rng.rank0", "rng.rank1"} <= keys and not any("chunks." in k or "slot_of_expert" in k for k in keys)
    inter = set(FileSystemReader(str(runs["tmp"] / "pp2_v2_dp1_ep1" / "checkpoints" / "step_2"))
                .read_metadata().state_dict_metadata)
    assert inter == keys  # interleaved chunks save the same keys as plain stages


def _saved_tensor_bytes(step_dir) -> int:
    """Bytes of the model and optimizer tensors a DCP checkpoint holds (its metadata: shape and dtype of each)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    return sum(m.size.numel() * torch.empty(0, dtype=m.properties.dtype).element_size() for k, m in meta.items()
               if isinstance(m, TensorStorageMetadata) and k.split(".")[0] in ("model", "optim"))


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["pp2_dp1_ep1", "pp1_dp2_ep2_zero3", "pp1_dp2_tp2_zero1"])
def test_checkpoint_size_equals_the_cost_model(runs, layout):
    """estimate's checkpoint size (cost/step.checkpoint_bytes) within 1% of the model and optimizer tensors the
    runtime saved (fp32 weights and AdamW's two fp32 moments: 12 bytes per parameter under zero 0, 1 and 3)."""
    from piper_plan.catalog import load_platform
    from piper_plan.cost.evaluate import estimate
    from piper_plan.cost.options import PIPER_RUNTIME_OPTIONS
    from piper_plan.planfile import parse_plan_dict

    cfg = parse_plan_dict(PLANS[layout], "test plan")
    local = load_platform("local-cpu")
    est = estimate(cfg.model, local, cfg.training, max(cfg.parallel.world // local.devices_per_node, 1), cfg.parallel,
                   options=PIPER_RUNTIME_OPTIONS)
    saved = _saved_tensor_bytes(runs["tmp"] / layout / "checkpoints" / "step_2")
    assert est.checkpoint.total_bytes == pytest.approx(saved, rel=0.01)
    assert est.checkpoint.bytes_per_param == 12


@pytest.mark.distributed
def test_same_layout_restores_each_ranks_rng_another_layout_reseeds(runs):
    saved = [r["rng"] for r in runs["train:pp2_dp1_ep1"]]
    same = [r["rng"] for r in runs["resume:same_layout_pp2"]]
    other = [r["rng"] for r in runs["resume:pp2_to_pp1_dp2_ep2"]]
    assert all(torch.equal(a, b) for a, b in zip(saved, same))
    assert not any(torch.equal(a, b) for a, b in zip(saved, other))
    assert not torch.equal(other[0], other[1])  # reseeded from (seed, step, rank)


@pytest.mark.distributed
@pytest.mark.parametrize("case,needle", [("other_model", "another model: model.moe.num_experts: 8 (checkpoint) vs 4"),
                                         ("missing_shard", "shard file __1_0.distcp is missing"),
                                         ("tied_head", "holds 'model.lm_head.weight', which no rank of this layout"),
                                         ("short_shard", "cannot load the checkpoint (rank 1")])
def test_bad_checkpoint_one_error_on_every_rank_nothing_changed(runs, case, needle):
    per_rank = runs[f"bad:{case}"]
    messages = {r["message"] for r in per_rank}
    assert len(messages) == 1, messages  # the same on every rank
    message = messages.pop()
    assert message is not None and needle in message and "\n" not in message, message
    assert all(r["unchanged"] for r in per_rank)


@pytest.mark.distributed
def test_dcp_gathers_a_one_rank_failure_to_every_rank(runs):
    messages = [r["message"] for r in runs["dcp_error"]]
    assert messages[0] == messages[1] and "no_such_weight" in messages[0] and "rank 1" in messages[0]


@pytest.mark.distributed
def test_world_2_to_1_in_process(runs, world1, tmp_path):
    from piper_plan.planfile import parse_plan_dict
    from piper_plan.runtime.train import Trainer

    want = _losses(runs["train:pp2_dp1_ep1"])[0][2:]
    shutil.copytree(runs["tmp"] / "pp2_dp1_ep1", tmp_path / "run")
    trainer = Trainer(parse_plan_dict(PLANS["pp1_dp1_ep1"], "test plan"), 0, 1, torch.device("cpu"), lr=1e-2,
                      aux_loss_coeff=0.0)
    start, _ = trainer.resume(tmp_path / "run")
    got = [trainer.train_step(s).report()["loss"] for s in range(start, 4)]
    assert start == 2 and got == pytest.approx(want, rel=RTOL)
    trainer.save(tmp_path / "run", 4)  # keep_checkpoints = 2: steps 2 and 4
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["latest", "step_2", "step_4"]


@pytest.mark.distributed
def test_a_failed_save_leaves_the_previous_checkpoint_usable(runs):
    per_rank = runs["failed_save"]
    assert [r["raised"] for r in per_rank] == ["PiperError"] * 2  # every rank, one line (DCP's failure), no hang
    for r in per_rank:
        assert r["latest"] == "2" and r["names"] == ["latest", "step_2", "step_4.tmp"]
        assert r["again"]["start"] == 2
    assert _losses([r["again"] for r in per_rank]) == [_losses(runs["train:pp2_dp1_ep1"])[0][2:]]
