"""The training runtime: ``python -m piper_plan.runtime.train --plan plan.json [--steps N] [--out RUN_DIR] [--resume]``.

Reads plan.json through planfile.read_plan_file (the one validated PlanFile; ``runtime`` and ``migration`` blocks
hold every setting and its default, the options only override them). Builds this rank's pipeline stage on the
meta device, splits and shards it there, then allocates and initialises only its own part (mesh.py for the rank
order, model.py for the weights), runs GPipe / 1F1B over pp with a chunked LM loss (pipeline.py), dispatches
tokens to experts over each EP group (flat or HALO), all-reduces dense gradients over dp and expert gradients
over edp in buckets launched during backward (runtime/grad_sync.py; FSDP2's own under zero 2/3), steps
AdamW / SGD with warmup + cosine decay and global-norm clipping (optionally ZeRO-1 sharded; runtime/optim.py),
gathers every rank's report as one tensor per step (runtime/report.py), migrates experts at step boundaries
(plan.json ``migration``;
runtime/migration.py), and writes metrics.jsonl + summary.json (global rank 0) and resharding checkpoints
(runtime/checkpoint.py: torch.distributed.checkpoint; resumable under another layout).
Bad input is found before any collective: rank 0 prints one line, every rank exits with 2. A loss that goes
nan / inf stops every rank at the same step (each reads it in the gathered reports): rank 0 prints one line,
every rank exits with EXIT_DIVERGED.
Tensor parallelism (tp > 1, always with sequence parallelism) splits the stage on the meta device, before the
seeded initialisation writes each rank's part (runtime/tensor_parallel.py).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import time
from pathlib import Path


def quiet_ctrl_c() -> None:
    """Until the stop flag's handler is in (nothing to checkpoint before), a Ctrl-C ends this rank the operating
    system's way: Python's KeyboardInterrupt printed a traceback per rank from wherever it was (importing pydantic,
    torch). An ignored SIGINT (a background run, nohup) stays ignored."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)


if __name__ == "__main__":              # a rank (python -m): before this module's own imports
    quiet_ctrl_c()

from piper_plan.errors import EXIT_CHECK_FAILED, EXIT_REQUEUE, EXIT_USER_ERROR, PiperError
from piper_plan.launchenv import check_visible_devices, device_index, read_launch_env
from piper_plan.metricsfile import PROCESS_RSS_KEY
from piper_plan.runtime.mesh import end_process_group
from piper_plan.rundir import (LAUNCHER_PID_ENV, check_run_dir, first_difference, hold_run_dir, keep_plan,
                               kept_records, plan_change)

EXIT_DIVERGED = EXIT_CHECK_FAILED
"""The loss went nan / inf: the run's check of its loss failed."""


# ---- plan and launch environment (no torch) -----------------------------------------------------
def with_runtime(cfg, **overrides):
    """The plan with runtime settings overridden (``piper run`` options; None = keep the plan's value)."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if not overrides:
        return cfg
    from pydantic import ValidationError

    from piper_plan.catalog import validation_message
    from piper_plan.planfile import RuntimeBlock

    try:
        runtime = RuntimeBlock.model_validate({**cfg.runtime.model_dump(), **overrides})
    except ValidationError as exc:        # --lr nan, --steps 0: one line, as a bad plan.json field would give
        raise PiperError(validation_message(exc), field="runtime options") from None
    return cfg.model_copy(update={"runtime": runtime})


def load_plan(args):
    """plan.json (planfile.read_plan_file: the one validated PlanFile) with the command line's overrides."""
    from piper_plan.planfile import read_plan_file

    return with_runtime(read_plan_file(args.plan), steps=args.steps, lr=args.lr, aux_loss_coeff=args.aux_loss_coeff,
                        mtp_loss_weight=args.mtp_loss_weight)


def preflight(cfg, world: int, cuda_available: bool) -> None:
    """Every check of the plan (planfile.PlanFile) that needs no communication; raises PiperError (one line)."""
    from piper_plan.capability import runtime_missing

    # the plan itself was checked by the one validity check when plan.json was read (planfile.read_plan_file)
    if cfg.parallel.world != world:
        raise PiperError(f"the plan's pp x dp x tp = {cfg.parallel.world} ranks, but the launcher started {world}",
                         field="parallel")
    problems = runtime_missing(cfg.parallel, cfg.model, cfg.training)
    if problems:
        raise PiperError("the runtime cannot run: " + "; ".join(problems), field="parallel")
    if cfg.platform.launch.device == "cuda" and not cuda_available:
        raise PiperError(f"platform {cfg.platform.name} runs on GPUs (launch.device='cuda') but this machine has "
                         "none visible to torch; use a CPU platform (launch.device='cpu')", field="platform.launch.device")
    if cfg.runtime.data:
        from piper_plan.runtime.data import open_token_file

        open_token_file(Path(cfg.runtime.data), cfg.model.vocab_size, cfg.training.seq_len, cfg.model.mtp_layers)


# ---- the trainer ------------------------------------------------------------------------------
class StepResult:
    """One step of one rank: its report row (a device tensor, runtime/report.py) and its migration event."""

    def __init__(self, row, migration, trainer) -> None:
        self.row, self.migration, self._trainer = row, migration, trainer

    def report(self) -> dict:
        """This rank's report alone, read on the host (tests and benchmarks; the run gathers every rank's)."""
        out = self._trainer.decode(self.row.cpu().tolist(), self._trainer.rank)
        return {**out, "migration": self.migration}


class Trainer:
    """This rank's part of the run: stage model, schedule, dispatcher, optimizer, data, accounting."""

    def __init__(self, cfg, rank: int, world: int, device, lr: float | None = None,
                 aux_loss_coeff: float | None = None, mesh=None) -> None:
        """cfg: the validated planfile.PlanFile; lr / aux_loss_coeff override its runtime block."""
        import torch

        from piper_plan.runtime.mesh import Mesh
        from piper_plan.runtime.optim import Optimizers

        cfg = with_runtime(cfg, lr=lr, aux_loss_coeff=aux_loss_coeff)
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        p = cfg.parallel
        self.mesh = mesh or Mesh.create(rank, p.pp, p.dp, p.ep, p.tp, device.type)
        self.seed = cfg.runtime.seed
        torch.manual_seed(self.seed + rank)
        from piper_plan.runtime.sharding import shard_stage_module

        from piper_plan.runtime.model import materialize

        self.module = shard_stage_module(self._build_model(cfg.runtime.aux_loss_coeff), self.mesh, p, cfg.training.dtype)
        materialize(self.module, device, self.seed)  # only this rank's shards are allocated
        named = list(self.module.named_parameters())
        self.tp_summed = []
        if p.tp > 1:
            from piper_plan.runtime.tensor_parallel import tp_summed_params

            self.tp_summed = tp_summed_params(self.module)
        dense = [(n, q) for n, q in named if ".experts." not in n]
        expert = [(n, q) for n, q in named if ".experts." in n]
        self.dense, self.expert = [q for _, q in dense], [q for _, q in expert]
        self.embedding_copy = self._embedding_copy()
        self.optimizer = Optimizers([(dense, self.mesh.dp_group, p.dp), (expert, self.mesh.edp_group, p.edp)],
                                    cfg.training, cfg.runtime, device, p.zero)
        from piper_plan.runtime.pipeline import loss_function

        self.loss_fn = loss_function(self.module, p.mbs * cfg.training.seq_len, cfg.runtime.loss_chunk_rows, p.tp,
                                     cfg.runtime.mtp_loss_weight)
        self.schedule = None
        if p.pp > 1:
            from piper_plan.runtime.pipeline import build_schedule

            self.schedule = build_schedule(self.module, self.mesh.me.pp_index, p.pp, self.mesh.pp_group,
                                           p.schedule, p.num_microbatches, device, self.loss_fn)
        from piper_plan.runtime.accounting import SavedTensorTracker
        from piper_plan.runtime.data import make_source
        from piper_plan.runtime.pipeline import P2PTimer

        self.data = make_source(cfg.runtime.data, cfg.model.vocab_size, cfg.training.seq_len, self.seed,
                                cfg.model.mtp_layers)
        self.tracker = SavedTensorTracker(self.module)
        self.p2p = P2PTimer()
        self.dp_sync_s = 0.0
        if self.schedule is not None:
            self._infer_shapes()
        self.reducer = self._reducer()
        from piper_plan.runtime.migration import ExpertMigrator

        self.migrator = ExpertMigrator.from_trainer(self, cfg.migration)

    def _infer_shapes(self) -> None:
        """The schedule infers stage shapes at its first step (running forward/backward on placeholder
        tensors, dispatch included); do that step now, on step 0's batch, and drop its gradients, so that
        step 0's expert counts and timings are real ones. No parameter or RNG state changes."""
        self.forward_backward(0)
        for q in self.module.parameters():
            q.grad = None

    # -- construction
    def _build_model(self, aux_loss_coeff: float):
        from piper_plan.runtime.model import build_rank_module

        spec, p, me = self.cfg.model, self.cfg.parallel, self.mesh.me
        moe_kwargs = {"ep_rank": me.ep_rank, "ep_size": p.ep, "ep_group": self.mesh.ep_group,
                      "dispatcher": self._dispatcher(), "aux_loss_coeff": aux_loss_coeff,
                      "seq_mesh": self.mesh.submesh("tp") if p.tp > 1 else None,
                      "overlap_shared": self.cfg.runtime.shared_expert_overlap}
        # StageModel, or VirtualStages (interleaved); plan.recompute applied inside (model.py). On the meta
        # device: split (tp) and sharded (FSDP2) before materialize allocates and initialises this rank's part
        import torch

        with torch.device("meta"):
            module = build_rank_module(spec, p, me.pp_index, moe_kwargs, seed=None)
        if p.tp > 1:
            from piper_plan.runtime.tensor_parallel import parallelize

            parallelize(module, self.mesh.submesh("tp"))
        return module

    def _embedding_copy(self):
        """(the word embedding, the group that sums its gradient) on the first and last stage where the last holds
        MTP modules and pp > 1 (its copy of the embedding: model.py); None elsewhere. The group joins the first
        and last stage ranks of one (dp, tp) position (collective: every rank builds every group)."""
        if not self.cfg.model.mtp_layers or self.cfg.parallel.pp == 1:
            return None
        group = self.mesh.first_last_group()
        stage = self.module.chunks[0] if hasattr(self.module, "chunks") else self.module
        if self.mesh.me.pp_index == 0:
            return stage.embed.weight, group
        if self.mesh.is_last_stage:
            last = self.module.chunks[-1] if hasattr(self.module, "chunks") else self.module
            return last.embed.weight, group
        return None

    def _dispatcher(self):
        p = self.cfg.parallel
        if p.ep == 1:
            return None
        if p.a2a == "halo":
            from piper_plan.runtime.halo import build_halo_dispatchers
            from piper_plan.runtime.topology import topology_from_env

            node = self.cfg.platform.node
            topo = topology_from_env(self.world, node.devices_per_node, node.device_nic)
            return build_halo_dispatchers(self.mesh.ep_group_ranks, topo, self.mesh.ep_group)
        from piper_plan.runtime.dispatch import FlatDispatcher

        return FlatDispatcher(self.mesh.ep_group)

    # -- one step
    def batch(self, step: int):
        from piper_plan.runtime.data import dp_slice

        tr, p = self.cfg.training, self.cfg.parallel
        x, y = dp_slice(self.data.batch(step, tr.global_batch), self.mesh.me.dp_index, p.dp, self.cfg.model.mtp_layers)
        return x.to(self.device), y.to(self.device)

    def forward_backward(self, step: int) -> list:
        """Zero grads, run every micro-batch of this dp rank through the pipeline; last-stage losses."""
        from piper_plan.runtime.casts import casts_once_per_step
        from piper_plan.runtime.pipeline import run_local, run_pipeline
        from piper_plan.runtime.tensor_parallel import loss_context

        for q in self.module.parameters():
            q.grad = None
        if hasattr(self.loss_fn, "parts"):
            self.loss_fn.parts.clear()
        x, y = self.batch(step)
        with self._autocast(), casts_once_per_step(), self._accounting(), loss_context(self.cfg.parallel.tp):
            if self.schedule is None:
                return run_local(self.module, x, y, self.cfg.parallel.num_microbatches, self.loss_fn)
            return run_pipeline(self.schedule, self.module.is_first, self.module.is_last, x, y)

    def _accounting(self):
        """The saved-tensor accounting on CPU (the memory figure there); none on GPUs, whose figure is the
        allocator's peak (no Python hook on every saved tensor)."""
        return self.tracker.hooks() if self.device.type == "cpu" else contextlib.nullcontext()

    def _autocast(self):
        import torch

        if precision_path(self.cfg, self.device) == "autocast":
            dtype = torch.bfloat16 if self.cfg.training.dtype == "bf16" else torch.float16
            return torch.autocast("cuda", dtype=dtype)
        return contextlib.nullcontext()

    def _reducer(self, bucket_bytes: int | None = None):
        """Dense grads: mean over dp. Expert grads: sum over edp, divided by dp (each expert rank already holds the
        contributions of its whole EP group's tokens). Bucketed and overlapped with backward (runtime/grad_sync.py);
        FSDP2-managed (zero 2/3) gradients are FSDP2's (runtime/sharding.py): only the others are reduced here."""
        from piper_plan.runtime.grad_sync import BUCKET_BYTES, OverlappedReducer
        from piper_plan.runtime.sharding import replicated

        p, m = self.cfg.parallel, self.mesh
        return OverlappedReducer([(replicated(self.dense), m.dp_group if p.dp > 1 else None, p.dp),
                                  (replicated(self.expert), m.edp_group if p.edp > 1 else None, p.dp)],
                                 p.num_microbatches, bucket_bytes or BUCKET_BYTES)

    def sync_grads(self) -> None:
        """The dp / edp reductions launched during backward completed (``_reducer``), then dense grads completed
        over tp (partial DTensor gradients reduced; replicated parameters that saw only this rank's tokens summed;
        linear, so after the dp mean as well as before)."""
        from piper_plan.runtime.grad_sync import allreduce_mean

        start = time.perf_counter()
        self.reducer.finish()
        if self.cfg.parallel.tp > 1:
            from piper_plan.runtime.tensor_parallel import finish_dtensor_grads

            finish_dtensor_grads(self.module)
            allreduce_mean(self.tp_summed, self.mesh.tp_group, 1)
        if self.embedding_copy is not None:   # first stage's + the MTP modules' (last stage's copy) gradient
            weight, group = self.embedding_copy
            allreduce_mean([weight], group, 1)
        self.dp_sync_s += time.perf_counter() - start

    def train_step(self, step: int) -> "StepResult":
        """One optimizer step: forward/backward, gradient sync, global-norm clipping, the scheduled learning
        rate, the optimizer step, then migration at the step boundary. The report stays a device tensor."""
        import torch

        from piper_plan.runtime.optim import clip_grads, global_grad_norm, lr_at

        self._reset_counters()
        start = time.perf_counter()
        self.reducer.arm()
        losses = self.forward_backward(step)
        self.sync_grads()
        memory = self.memory_bytes()
        rt, p = self.cfg.runtime, self.cfg.parallel
        self.grad_norm = global_grad_norm(self._norm_dense(), self.expert, p.dp, p.edp, self.device, p.tp)
        if rt.grad_clip_norm is not None:
            clip_grads(self.dense + self.expert, rt.grad_clip_norm, self.grad_norm)
        self.optimizer.set_lr(lr_at(step, rt.steps, rt))
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        migration = self._migrate(step)
        values = {**memory, "seconds": seconds, "a2a": self._a2a_seconds(), "p2p": self.p2p.seconds,
                  "dp_sync": self.dp_sync_s, "stage": self.mesh.me.pp_index, "dp_index": self.mesh.me.dp_index,
                  "stop": 0, "write_failed": 0}
        return StepResult(self._encode(values, self._mean_loss(losses)), migration, self)

    def _norm_dense(self) -> list:
        """The dense parameters whose gradients enter the global norm: the last stage's copy of the embedding
        (MTP, pp > 1) left out, as its gradient equals the first stage's."""
        if self.embedding_copy is None or not self.mesh.is_last_stage:
            return self.dense
        return [q for q in self.dense if q is not self.embedding_copy[0]]

    def _mean_loss(self, losses: list) -> dict:
        """The step's mean loss over micro-batches and dp ranks as {"loss": device tensor} (empty off the last
        stage); with MTP modules "loss" is the next-token loss and "mtp_loss" the mean of theirs (MTPLoss.parts)."""
        import torch
        import torch.distributed as dist

        if not self.module.is_last:
            return {}
        parts = getattr(self.loss_fn, "parts", None)
        per_mb = {"loss": losses} if not parts else {"loss": [p[0] for p in parts], "mtp_loss": [p[1] for p in parts]}
        means = {k: torch.stack(v).mean().detach().float() for k, v in per_mb.items()}
        if self.cfg.parallel.dp > 1:
            for mean in means.values():
                dist.all_reduce(mean, group=self.mesh.dp_group)
                mean /= self.cfg.parallel.dp
        return means

    def _encode(self, values: dict, losses: dict):
        from piper_plan.runtime.report import encode

        tokens = {i: m.expert_tokens for i, m in self.module.moe_layers().items()}
        return encode(self.cfg.model, values, losses, tokens, self.device)

    def decode(self, row: list[float], rank: int) -> dict:
        """A gathered report row -> train.merge_reports' per-rank dict."""
        from piper_plan.runtime.metrics import MEMORY_SOURCE_CPU, MEMORY_SOURCE_GPU
        from piper_plan.runtime.report import decode

        source = MEMORY_SOURCE_GPU if self.device.type == "cuda" else MEMORY_SOURCE_CPU
        return decode(self.cfg.model, row, rank, source)

    def gather_reports(self, result: "StepResult", step: int, stop: bool, write_failed: bool = False) -> list[dict]:
        """Every rank's report of step ``step``: one tensor all-gather and one host read; the migration events
        travel as objects only on the steps where migration ran (collective: every rank calls it)."""
        import torch
        import torch.distributed as dist

        from piper_plan.runtime.report import FIELDS

        row = result.row.clone()
        row[FIELDS.index("stop")] = float(stop)
        row[FIELDS.index("write_failed")] = float(write_failed)
        parts = [torch.empty_like(row) for _ in range(self.world)]
        dist.all_gather(parts, row)
        reports = [self.decode(r, rank) for rank, r in enumerate(torch.stack(parts).cpu().tolist())]
        if self._migration_step(step):
            events = [None] * self.world
            dist.all_gather_object(events, result.migration)
            for report, event in zip(reports, events):
                report["migration"] = event
        return reports

    def _migration_step(self, step: int) -> bool:
        """Whether migration ran at this step boundary (the same answer on every rank)."""
        m = self.cfg.migration
        return m.enabled and self.cfg.parallel.ep > 1 and (step + 1) % m.interval == 0

    def _migrate(self, step: int):
        """Step boundary: record expert loads; every migration.interval steps rebalance (runtime/migration.py)."""
        if self.migrator is None:
            return None
        self.migrator.observe()
        return self.migrator.step_boundary(step)

    def _reset_counters(self) -> None:
        self.p2p.seconds = self.dp_sync_s = 0.0
        self.tracker.reset_peak()
        for m in self.module.moe_layers().values():
            m.expert_tokens.zero_()
            if m.dispatcher is not None and hasattr(m.dispatcher, "timer"):
                m.dispatcher.timer.reset()
        if self.device.type == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)

    def _a2a_seconds(self) -> float:
        seen, total = set(), 0.0
        for m in self.module.moe_layers().values():
            timer = getattr(m.dispatcher, "timer", None)
            if timer is not None and id(timer) not in seen:
                seen.add(id(timer))
                total += timer.seconds
        return total

    def memory_bytes(self) -> dict:
        """This rank's memory: the allocator's peak on GPUs, the runtime's tensor accounting on CPU
        (metrics.MEMORY_SOURCE_GPU / _CPU)."""
        from piper_plan.runtime.accounting import tensor_bytes

        params = tensor_bytes(self.module.parameters())
        grads = tensor_bytes(q.grad for q in self.module.parameters())
        optim, acts = self.optimizer.state_bytes(), self.tracker.peak_bytes
        out = {"parameters_bytes": params, "gradients_bytes": grads,
               "optimizer_bytes": optim, "activations_bytes": acts}
        if self.device.type == "cuda":
            import torch

            return {**out, "total_bytes": int(torch.cuda.max_memory_allocated(self.device))}
        return {**out, "total_bytes": params + grads + optim + acts, PROCESS_RSS_KEY: peak_rss_bytes()}

    # -- checkpoints (runtime/checkpoint.py: torch.distributed.checkpoint, layout-free keys)
    def checkpoint_state(self):
        from piper_plan.runtime.checkpoint import RankState

        return RankState(self.module, self.optimizer, self.cfg, self.rank, self.world)

    def save(self, run_dir: Path, step: int) -> None:
        from piper_plan.runtime.checkpoint import save

        save(run_dir, step, self.checkpoint_state(), self.cfg.runtime.keep_checkpoints)

    def resume(self, run_dir: Path) -> tuple[int, int | None]:
        """The step to continue from and the saving run's schedule total (checkpoint.load); PiperError (the same on
        every rank) for a checkpoint it cannot load."""
        from piper_plan.runtime.checkpoint import load

        return load(run_dir, self.checkpoint_state())


def resumed_schedule(cfg, steps_given: int | None, saved: int | None, start: int):
    """The run's learning-rate schedule on --resume: without --steps, over the total steps the checkpoint's run was
    started with (before, the plan's runtime.steps replaced it: a run of 30 steps stopped and resumed as its stop line
    says went on to the plan's 100, on another cosine); with --steps of another total, the new one and a note.
    Returns the config and the note (None where nothing changes)."""
    if saved is None or saved == cfg.runtime.steps:
        return cfg, None
    if steps_given is None:
        kept = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"steps": saved})})
        return kept, (f"--resume: the run continues to its own {saved} steps (plan.json's runtime.steps: "
                      f"{cfg.runtime.steps}; --steps sets another total)")
    return cfg, (f"--steps {steps_given}: the checkpoint's run scheduled its learning rate over {saved} steps; "
                 f"from step {start} it follows the cosine of {steps_given} steps")


# ---- rank-0 reporting ---------------------------------------------------------------------------
def non_finite_loss(reports: list[dict], last_stage: int, names=("loss",)) -> tuple[str, float] | None:
    """(name, value) of the first loss among ``names`` that a last-stage rank reports as nan or +-inf, else None.
    A nan loss decodes as None (report.decode: nan marks a rank without a loss), so a last-stage rank without one
    has a nan loss."""
    for r in (r for r in reports if r["stage"] == last_stage):
        for name in names:
            value = math.nan if r.get(name) is None else r[name]
            if not math.isfinite(value):
                return name, value
    return None


def divergence(reports: list[dict], step: int, cfg) -> str | None:
    """The one line of a step whose loss (or MTP loss) went nan / inf, else None; the same on every rank (the
    reports are gathered)."""
    names = ("loss", "mtp_loss") if cfg.model.mtp_layers else ("loss",)
    found = non_finite_loss(reports, cfg.parallel.pp - 1, names)
    if found is None:
        return None
    rt = cfg.runtime
    return (f"step {step}: the {found[0]} is {found[1]} (runtime.lr {rt.lr:g}, runtime.weight_decay "
            f"{rt.weight_decay:g}, runtime.aux_loss_coeff {rt.aux_loss_coeff:g}): the run diverged; lower --lr / "
            "--aux-loss-coeff or the plan's runtime block")


def peak_rss_bytes() -> int:
    """This process's peak resident set size (getrusage ru_maxrss: KiB on Linux)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _stage_memory(memories: list[dict]) -> dict:
    """A stage's memory entry: its ranks' largest tensor (or allocator) figure, with the largest process RSS of
    any of them where the ranks measure one (CPU)."""
    entry = dict(max(memories, key=lambda m: m["total_bytes"]))
    rss = [m[PROCESS_RSS_KEY] for m in memories if PROCESS_RSS_KEY in m]
    if rss:
        entry[PROCESS_RSS_KEY] = max(rss)
    return entry


def merge_reports(reports: list[dict], step: int, tokens: int, parallel: dict | None = None):
    """All ranks' step reports -> one metrics.jsonl record (DESIGN.md)."""
    from piper_plan.runtime.metrics import step_record

    loss = next(r["loss"] for r in reports if r["loss"] is not None)
    stages = sorted({r["stage"] for r in reports})
    memory = [_stage_memory([r["memory"] for r in reports if r["stage"] == s]) for s in stages]
    experts: dict[str, list[int]] = {}
    for r in reports:
        for layer, counts in r["expert_tokens"].items():
            acc = experts.setdefault(str(layer), [0] * len(counts))
            experts[str(layer)] = [a + c for a, c in zip(acc, counts)]
    from piper_plan.runtime.migration import merge_events

    migrations = merge_events(reports)  # stages migrate concurrently: the slowest one's time
    time_s = {k: max(r["time_s"][k] for r in reports) for k in ("a2a", "p2p", "dp_sync")}
    time_s["migration"] = max((e["seconds"] for e in migrations), default=0.0)
    seconds = max(r["seconds"] for r in reports)
    record = step_record(step, loss, seconds, tokens, time_s, memory,
                         dict(sorted(experts.items(), key=lambda kv: int(kv[0]))), migrations, parallel)
    mtp = next((r["mtp_loss"] for r in reports if r.get("mtp_loss") is not None), None)
    return record if mtp is None else {**record, "mtp_loss": mtp}


# ---- entry point --------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m piper_plan.runtime.train", description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True, help="plan.json (piper estimate/plan --save, piper launch)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: plan runtime.steps)")
    ap.add_argument("--out", default="run", help="run directory (metrics.jsonl, summary.json, checkpoints/)")
    ap.add_argument("--resume", action="store_true", help="continue from RUN_DIR/checkpoints/latest")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="record a torch profiler Chrome trace of STEPS steps after the first")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: plan runtime.lr)")
    ap.add_argument("--aux-loss-coeff", type=float, default=None,
                    help="Switch balance-loss coefficient, 0 = off (default: plan runtime.aux_loss_coeff)")
    ap.add_argument("--mtp-loss-weight", type=float, default=None,
                    help="weight of the multi-token-prediction loss (default: plan runtime.mtp_loss_weight)")
    return ap.parse_args(argv)


PEER_LOST_MESSAGES = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket closed")
"""What gloo's TCP transport says when a rank at the other end of a collective has gone (gloo/transport/tcp/pair.cc)."""
EXIT_PEER_LOST = EXIT_CHECK_FAILED


def peer_lost(exc: BaseException) -> str | None:
    """The short reason when ``exc`` says a peer rank is gone (its connection closed under a collective), else
    None (any other error keeps its traceback)."""
    text = str(exc)
    found = next((m for m in PEER_LOST_MESSAGES if m in text), None)
    return None if found is None else f"gloo: {found}"


def _lost_peer(rank: int, step: int | None, reason: str) -> int:
    """One line for a rank whose peer is gone (at step ``step``, else outside the steps); the exit code (no
    collective after it: the group is broken)."""
    where = f"step {step + 1}" if step is not None else "outside a step"
    print(f"error: rank {rank}, {where}: a rank it exchanges with is gone ({reason}); the run stops (the "
          "launcher names the rank that ended first; --resume continues from the last checkpoint)",
          file=sys.stderr, flush=True)
    return EXIT_PEER_LOST


LAUNCHER_POLL_S = 0.5
"""How often a rank of `piper run`'s own launcher checks that the launcher is still its parent."""


class _StopFlag:
    """SIGTERM / SIGUSR1 / SIGINT (Ctrl-C) set a flag; the loop checkpoints at the end of the step and exits 75.
    After the first SIGINT the default action is back, so a second Ctrl-C stops at once; a SIGINT ignored when the
    process started (a background job) stays ignored. release(): the handlers from before."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.signum = 0
        for sig in self.SIGNALS:
            signal.signal(sig, self._set)
        self._int_before = signal.getsignal(signal.SIGINT)
        if self._int_before is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, self._set)

    def _set(self, signum, frame) -> None:
        self.signum = signum
        if signum == signal.SIGINT:
            # a second Ctrl-C stops this rank at once, the operating system's default way: not Python's
            # KeyboardInterrupt, which would wait until a rank blocked in a collective returns to Python
            signal.signal(signal.SIGINT, signal.SIG_DFL)

    def watch_launcher(self, launcher_pid: int) -> None:
        """Set the flag, as a stop signal would, once this process's parent is no longer ``launcher_pid``: the
        ranks of a `piper run` whose launcher was killed checkpoint and stop rather than train on unwatched."""
        import threading

        def watch() -> None:
            while os.getppid() == launcher_pid:
                time.sleep(LAUNCHER_POLL_S)
            self.signum = self.signum or signal.SIGHUP

        threading.Thread(target=watch, name="piper-launcher-watch", daemon=True).start()

    def release(self) -> None:
        """Default handlers again (a run that ends on bad input: torchrun's SIGTERM then ends a waiting rank)."""
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        if self._int_before is not None:
            signal.signal(signal.SIGINT, self._int_before)


CRASH_SIGNALS = ("SIGSEGV", "SIGFPE", "SIGABRT", "SIGBUS", "SIGILL")
"""The signals on which a rank prints every thread's Python stack to its stderr before it dies (faulthandler's
fatal signals: a crash in native code, torch's or gloo's, or glibc's abort on a damaged heap)."""


def main(argv=None) -> int:
    import faulthandler

    faulthandler.enable(all_threads=True)        # CRASH_SIGNALS: where each thread was, before the rank dies
    quiet_ctrl_c()                               # a rank started as `piper run` under torchrun / srun
    args = parse_args(argv)
    env = read_launch_env()
    rank, world, local = env.rank, env.world_size, env.local_rank
    import torch

    try:
        cfg = load_plan(args)
        preflight(cfg, world, torch.cuda.is_available())
        if cfg.platform.launch.device == "cuda":
            check_visible_devices(torch.cuda.device_count(), env.ranks_per_node, env.launcher)
        check_run_dir(Path(args.out))          # torchrun / srun start ranks without piper run's launcher
        rendezvous_timeout_s()
    except PiperError as exc:
        return _report_user_error(exc, rank)
    try:
        return run(cfg, args, rank, world, local)
    except RuntimeError as exc:      # a peer gone outside a step (the start's agreements, a checkpoint's load): before,
        if (reason := peer_lost(exc)) is None:                      # a traceback on every rank left
            raise
        return _lost_peer(rank, None, reason)


RENDEZVOUS_TIMEOUT_ENV = "PIPER_RENDEZVOUS_TIMEOUT_S"
RENDEZVOUS_TIMEOUT_S = 300.0
"""How long a rank waits for every rank to join the rendezvous (env:// store: rank 0's TCPStore waits for WORLD_SIZE
ranks to connect, the others for rank 0's store) before it gives up with one line; PIPER_RENDEZVOUS_TIMEOUT_S
overrides it. Only the rendezvous: the process group's own timeout (collectives under gloo, NCCL's watchdog) stays
torch's default (30 min), as a step (or a checkpoint save that other ranks wait for at a barrier) may take long."""


def rendezvous_timeout_s(environ=os.environ) -> float:
    text = environ.get(RENDEZVOUS_TIMEOUT_ENV, "").strip()
    if not text:
        return RENDEZVOUS_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 86400):
        raise PiperError(f"{text[:40]!r}; allowed: seconds, a number in (0, 86400]", field=RENDEZVOUS_TIMEOUT_ENV)
    return value


# Every rank reads the same plan, so a bad one fails on every rank; only rank 0 says why. torchrun stops all ranks
# when the first one exits, so before the process group is up the other ranks give rank 0 this long to print before
# they exit: else a fast rank 1 gets rank 0 killed before its one line is out (seen in CI). Under srun they exit this
# much later: bounded, no hang. Once the group is up they wait for the line at a barrier instead
# (_report_user_error_together; a damaged checkpoint's ranks exited 20 s after its line, now with it).
RANK0_REPORT_GRACE_S = 20.0


def _report_user_error(exc: PiperError | None, rank: int, reporter: int = 0) -> int:
    """Exit code 2 with one line, printed by rank ``reporter`` (the others give it time to print first: there is no
    process group yet to wait on it with)."""
    if rank == reporter and exc is not None:
        print(f"error: {exc}", file=sys.stderr, flush=True)
    else:
        time.sleep(RANK0_REPORT_GRACE_S)
    return EXIT_USER_ERROR


def _report_user_error_together(exc: PiperError | None, rank: int, reporter: int = 0) -> int:
    """``_report_user_error`` once the process group is up (every rank alive and agreed that rank ``reporter`` says
    why): it prints, then all leave one barrier, so no rank exits before the line is out and none waits longer."""
    import torch.distributed as dist

    if rank == reporter and exc is not None:
        print(f"error: {exc}", file=sys.stderr, flush=True)
    dist.barrier()
    end_process_group()
    return EXIT_USER_ERROR


def started_alike(cfg, args, world: int) -> str | None:
    """Collective: where the ranks were started with different plans or options (torchrun / srun run one command
    per node; a node given --steps 7 and another --steps 5 hung at the first's last step, and --lr differing per
    node trained data-parallel copies apart), the first difference from rank 0's, as one line; None if alike.
    One all-gather of a digest; the whole settings only where the digests differ."""
    import hashlib
    import json

    import torch.distributed as dist

    mine = {"plan": cfg.model_dump(mode="json"), "resume": bool(args.resume)}
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True, default=str).encode()).hexdigest()
    digests: list = [None] * world
    dist.all_gather_object(digests, digest)
    if len(set(digests)) == 1:
        return None
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    other = next(r for r, d in enumerate(digests) if d != digests[0])
    found = first_difference(every[0], every[other], labels=("rank 0", f"rank {other}"))
    return (f"the ranks were started with different settings: {found}; allowed: the same plan.json and options on "
            "every node")


def first_failed_rank(failed: bool, rank: int, world: int, device) -> int | None:
    """The lowest rank that failed, known to every rank (one all-reduce, so also a barrier); None when none did."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([rank if failed else world], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    first = int(value.item())
    return None if first == world else first


def select_device(cfg, local: int):
    """This rank's device: on GPUs the local rank modulo the visible devices (0 under --gpus-per-task=1),
    made current; else the CPU."""
    import torch

    if cfg.platform.launch.device != "cuda":
        return torch.device("cpu")
    index = device_index(local, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _init(cfg, rank: int, world: int, local: int):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    device = select_device(cfg, local)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if not dist.is_initialized():
        backend = cfg.platform.launch.backend if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=_rendezvous(rank, world), rank=rank, world_size=world)
    if device.type == "cpu":
        quiet_gloo_notices()
    return device


GLOO_NOTICES = ("torch.distributed.tensor._collective_utils",)
"""torch loggers whose warnings on gloo say only that torch works around a collective gloo lacks (DTensor's
all-to-all as all-gather + chunk, once per rank): nothing a user of piper's runtime can act on."""


def quiet_gloo_notices() -> None:
    import logging

    for name in GLOO_NOTICES:
        logging.getLogger(name).setLevel(logging.ERROR)


class RendezvousFailed(Exception):
    """Not every rank joined the rendezvous in time (one line, printed by every rank that saw it)."""


def _rendezvous(rank: int, world: int):
    """init_process_group's own env:// rendezvous (its store, with the timeout put back to the process group's and
    under the same "default_pg" prefix), waiting at most rendezvous_timeout_s() for the other ranks; a rank that
    never comes is RendezvousFailed, not a 30-minute silence."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout
    from torch.distributed.rendezvous import rendezvous

    limit = rendezvous_timeout_s()
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        store, _, _ = next(rendezvous("env://", rank, world, timeout=timedelta(seconds=limit)))
    except (RuntimeError, ValueError) as exc:  # DistStoreError / DistNetworkError (RuntimeError), a bad port
        detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        missing = ("waited for the other ranks to connect to its store" if rank == 0 else
                   "could not reach rank 0's store")
        raise RendezvousFailed(
            f"rank {rank} of {world}: rendezvous at {where} (MASTER_ADDR:MASTER_PORT) failed after {limit:g} s: "
            f"{missing} ({detail}); start all {world} ranks with the same MASTER_ADDR / MASTER_PORT / WORLD_SIZE "
            f"(a missing or dead rank), or raise {RENDEZVOUS_TIMEOUT_ENV}") from None
    store.set_timeout(default_pg_timeout)
    return dist.PrefixStore("default_pg", store)


def run(cfg, args, rank: int, world: int, local: int) -> int:
    """Train the plan (planfile.PlanFile, runtime settings already resolved: with_runtime)."""
    from piper_plan.fileio import atomic_write_json
    from piper_plan.runtime.metrics import MetricsWriter, ProgressLine, summarise

    try:
        device = _init(cfg, rank, world, local)
    except RendezvousFailed as exc:  # rank 0 may be the missing one: every rank that waited in vain says so
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    mismatch = started_alike(cfg, args, world)
    if mismatch:                        # before any collective that depends on them: they would hang or diverge
        return _report_user_error_together(PiperError(mismatch), rank)
    stop = _StopFlag()
    run_dir = Path(args.out)
    launcher_pid = os.environ.get(LAUNCHER_PID_ENV)
    if launcher_pid:                    # started by `piper run` on this machine: hold the directory with it
        stop.watch_launcher(int(launcher_pid))
        hold_run_dir(run_dir, launcher=False)
    trainer = Trainer(cfg, rank, world, device)
    problem = None
    try:  # the same on every rank (checkpoint.load agrees on it; the rest reads files): nothing written yet
        start, saved_steps = trainer.resume(run_dir) if args.resume else (0, None)
        records = kept_records(run_dir / "metrics.jsonl", start) if args.resume else []
        plan_note = plan_change(Path(args.plan), run_dir)
    except PiperError as exc:
        problem = exc
    # Every rank has read metrics.jsonl and plan.json before rank 0 rewrites them, and a rank that failed alone
    # (a run directory other nodes do not see) stops every rank now, not at the first step's collective.
    first = first_failed_rank(problem is not None, rank, world, device)
    if first is not None:
        stop.release()
        return _report_user_error_together(problem, rank, reporter=first)
    cfg, schedule_note = resumed_schedule(cfg, args.steps, saved_steps, start)
    trainer.cfg = cfg
    steps, interval = cfg.runtime.steps, cfg.runtime.checkpoint_interval
    tokens = cfg.training.global_batch * cfg.training.seq_len
    parallel = cfg.parallel.model_dump(mode="json")
    records = records if rank == 0 else []
    writer = None
    if rank == 0:
        try:                            # the run directory's files, rewritten: a full disk stops every rank here
            writer = MetricsWriter(run_dir / "metrics.jsonl", resume=False)
            if plan_note is None or start < steps:   # no step left: plan.json stays that of the records
                keep_plan(Path(args.plan), run_dir)
            for r in records:
                writer.write(r)
        except (OSError, PiperError) as exc:
            problem = PiperError(written_line(exc, run_dir / "metrics.jsonl"))
    first = first_failed_rank(problem is not None, rank, world, device)
    if first is not None:
        stop.release()
        return _report_user_error_together(problem, rank, reporter=first)
    progress = ProgressLine(steps) if rank == 0 else None
    if rank == 0 and plan_note and start < steps:
        print(f"note: {plan_note}", file=sys.stderr, flush=True)
    if rank == 0 and schedule_note:
        print(f"note: {schedule_note}", file=sys.stderr, flush=True)
    if rank == 0 and start >= steps:
        print(f"note: resumed at step {start}, at or past the run's {steps} steps: no step to run (raise --steps "
              "to train on)", file=sys.stderr, flush=True)
    if rank == 0 and precision_path(cfg, device) == "fp32 instead":
        print(f"note: training.dtype {cfg.training.dtype} with zero {cfg.parallel.zero} on the CPU trains in fp32 "
              "(autocast is used on GPUs only; with zero 2 / 3 FSDP2 casts; docs/design-notes.md)",
              file=sys.stderr, flush=True)
    if rank == 0 and args.resume and start == 0:
        print(f"note: --resume: no checkpoint in {run_dir / 'checkpoints'}: training from step 0",
              file=sys.stderr, flush=True)
    code, failure, write_failure, stop_ranks = 0, None, None, []
    for step in range(start, steps):
        try:
            with _profiler(args.profile, step - start, run_dir, rank) as _:
                result = trainer.train_step(step)
            gathered = trainer.gather_reports(result, step, stop=bool(stop.signum),
                                              write_failed=write_failure is not None)
        except PiperError as exc:         # a token id out of range: every rank reads the whole batch, all stop here
            code, failure = EXIT_USER_ERROR, str(exc)
            break
        except RuntimeError as exc:       # a rank it exchanges with is gone: one line, not a traceback per rank
            if (reason := peer_lost(exc)) is None:
                raise
            return _lost_peer(rank, step, reason)
        if any(r["write_failed"] for r in gathered):    # rank 0 could not write the last step's record
            code, failure = EXIT_USER_ERROR, write_failure
            break
        failure = divergence(gathered, step + 1, cfg)
        if failure:                       # every rank reads the same reports: every rank stops here
            code = EXIT_DIVERGED
            break
        if rank == 0:
            records.append(merge_reports(gathered, step + 1, tokens, parallel))
            if step == start:             # this invocation's first step: allocation, connections (compare skips it)
                records[-1]["warmup"] = True
            try:                          # the others learn of a failure with the next step's reports
                writer.write(records[-1])
            except OSError as exc:
                write_failure = written_line(exc, writer.path)
            progress.update(records[-1])
        saved = (step + 1) % interval == 0 or step + 1 == steps    # and the last step's: --resume continues it
        stopping = any(r["stop"] for r in gathered)
        try:
            if saved or stopping:
                trainer.save(run_dir, step + 1)
        except PiperError as exc:         # a write every rank was told of (checkpoint.save agrees on it)
            code, failure = EXIT_USER_ERROR, str(exc)
            break
        except RuntimeError as exc:
            if (reason := peer_lost(exc)) is None:
                raise
            return _lost_peer(rank, step, reason)
        if stopping:
            code = EXIT_REQUEUE if step + 1 < steps else 0      # the last step done: nothing left to requeue for
            stop_ranks = [i for i, r in enumerate(gathered) if r["stop"]]     # the signalled ones: piper run names
            break
    if rank == 0:
        progress.close()
        failure = failure or write_failure        # the last step's record: no step after it to stop at
        code = EXIT_USER_ERROR if write_failure and code in (0, EXIT_REQUEUE) else code
        try:
            writer.close()
            atomic_write_json(run_dir / "summary.json", {**summarise(records), "exit_code": code,
                                                         "world": world, "device": device.type,
                                                         **({"stop_ranks": stop_ranks} if stop_ranks else {})})
        except (OSError, PiperError) as exc:
            failure, code = failure or written_line(exc, run_dir / "summary.json"), EXIT_USER_ERROR
        if failure:
            print(f"error: {failure}", file=sys.stderr, flush=True)
    if first_failed_rank(rank == 0 and code == EXIT_USER_ERROR, rank, world, device) is not None:
        code = EXIT_USER_ERROR            # every rank leaves with rank 0's code (also the barrier before the end)
    end_process_group()
    return code


def written_line(exc: OSError | PiperError, path: Path) -> str:
    """A write of ``path`` in the run directory that failed (a full disk), as one line (PiperError's own line: a
    write through fileio names its file)."""
    if isinstance(exc, PiperError):
        return str(exc)
    return f"{exc.filename or path}: cannot write: {exc.strerror or exc}; allowed: a run directory with room"


def precision_path(cfg, device) -> str:
    """How the plan's training.dtype is trained on ``device``: "fp32" (an fp32 plan), "fsdp2" (zero 2 / 3: FSDP2's
    mixed-precision policy casts), "autocast" (16-bit, zero 0 / 1, on a GPU: Trainer._autocast) or "fp32 instead"
    (16-bit, zero 0 / 1, on the CPU: no autocast there; docs/design-notes.md)."""
    from piper_plan.capability import uses_fsdp

    if cfg.training.dtype not in ("bf16", "fp16"):
        return "fp32"
    if uses_fsdp(cfg.parallel):
        return "fsdp2"
    return "autocast" if device.type == "cuda" else "fp32 instead"


@contextlib.contextmanager
def _profiler(profile_steps: int, index: int, run_dir: Path, rank: int):
    """Profile steps 1..profile_steps after the first (warm-up) step of this invocation; one trace per step."""
    if not profile_steps or not 1 <= index <= profile_steps:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile

    import torch

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts, record_shapes=True) as prof:
        yield prof
    run_dir.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(run_dir / f"trace_step{index}_rank{rank}.json"))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # every file is written and closed by now: skip the interpreter teardown, which may abort (mesh.end_process_group)
    os._exit(code)
