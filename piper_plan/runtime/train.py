"""The training runtime: ``python -m piper_plan.runtime.train --plan plan.json [--steps N] [--out RUN_DIR] [--resume]``.

Builds this rank's pipeline stage from plan.json (mesh.py for the rank order, model.py for the weights), runs
GPipe / 1F1B over pp, dispatches tokens to experts over each EP group (flat or HALO), all-reduces dense
gradients over dp and expert gradients over edp (bucketed, one flat buffer per <= 2^25 elements), steps
AdamW / SGD (optionally ZeRO-1 sharded), migrates experts at step boundaries (plan.json ``migration``;
runtime/migration.py), and writes metrics.jsonl + summary.json (global rank 0) and per-rank checkpoints.
Bad input is found before any collective: rank 0 prints one line, every rank exits with 2.
Tensor parallelism is not implemented (tp = 1; capability.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from piper_plan.errors import EXIT_REQUEUE, EXIT_USER_ERROR, PiperError
from piper_plan.launchenv import device_index, read_launch_env


# ---- plan and launch environment (no torch) -----------------------------------------------------
@dataclass
class RunConfig:
    """What the runtime reads from plan.json."""

    model: object
    platform: object
    training: object
    parallel: object
    runtime: dict = field(default_factory=dict)
    migration: dict = field(default_factory=dict)
    """plan.json's migration block (runtime/migration.py MigrationSettings)."""


def config_from_dict(data: dict, path: str = "plan.json") -> RunConfig:
    """plan.json's mapping -> specs; validates only model, platform, training and parallel (the derived
    ``parallel.edp`` is dropped), for plans built in memory by tests and benchmarks. Files go through read_plan."""
    from piper_plan.catalog import parse_spec
    from piper_plan.specs import ModelSpec, ParallelPlan, PlatformSpec, TrainingSpec

    missing = [k for k in ("model", "platform", "training", "parallel") if k not in data]
    if missing:
        raise PiperError(f"missing {', '.join(missing)}; a plan.json has model, platform, training, parallel", path=path)
    parallel = {k: v for k, v in data["parallel"].items() if k != "edp"}
    return RunConfig(parse_spec(ModelSpec, data["model"], f"{path}: model"),
                     parse_spec(PlatformSpec, data["platform"], f"{path}: platform"),
                     parse_spec(TrainingSpec, data["training"], f"{path}: training"),
                     parse_spec(ParallelPlan, parallel, f"{path}: parallel"), dict(data.get("runtime") or {}),
                     dict(data.get("migration") or {}))


def read_plan(path: str | Path) -> RunConfig:
    """plan.json, validated by planfile.read_plan_file (stricter than config_from_dict)."""
    from piper_plan.planfile import read_plan_file

    pf = read_plan_file(path)
    return RunConfig(pf.model, pf.platform, pf.training, pf.parallel, pf.runtime.model_dump(),
                     pf.migration.model_dump())


def preflight(cfg: RunConfig, world: int, cuda_available: bool) -> None:
    """Every check that needs no communication; raises PiperError (one line)."""
    from piper_plan.capability import unsupported_features

    # the plan itself was checked by the one validity check when plan.json was read (planfile.read_plan_file)
    if cfg.parallel.world != world:
        raise PiperError(f"the plan's pp x dp x tp = {cfg.parallel.world} ranks, but the launcher started {world}",
                         field="parallel")
    problems = unsupported_features(cfg.parallel, cfg.model)
    if problems:
        raise PiperError("the runtime cannot run: " + "; ".join(problems), field="parallel")
    if cfg.platform.launch.device == "cuda" and not cuda_available:
        raise PiperError(f"platform {cfg.platform.name} runs on GPUs (launch.device='cuda') but this machine has "
                         "none visible to torch; use a CPU platform (launch.device='cpu')", field="platform.launch.device")
    if cfg.runtime.get("data"):
        from piper_plan.runtime.data import open_token_file

        open_token_file(Path(cfg.runtime["data"]), cfg.model.vocab_size, cfg.training.seq_len)


# ---- the trainer ------------------------------------------------------------------------------
class Optimizers:
    """One optimizer per gradient group (dense over dp, experts over edp); ZeRO-1 shards each over its group."""

    def __init__(self, groups: list[tuple[list, object, int]], training, lr: float, zero: int) -> None:
        import torch
        from torch.distributed.optim import ZeroRedundancyOptimizer

        cls, kw = (torch.optim.AdamW, {"weight_decay": 0.0}) if training.optimizer == "adam" else (torch.optim.SGD, {})
        self.optims = []
        for params, group, size in groups:
            if not params:
                continue
            if zero and size > 1:
                self.optims.append(ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=group, lr=lr, **kw))
            else:
                self.optims.append(cls(params, lr=lr, **kw))

    def _inner(self):
        return [getattr(o, "optim", o) for o in self.optims]

    def step(self) -> None:
        for o in self.optims:
            o.step()

    def state_dict(self) -> list:
        return [o.state_dict() for o in self._inner()]

    def load_state_dict(self, states: list) -> None:
        for o, s in zip(self._inner(), states):
            o.load_state_dict(s)

    def state_bytes(self) -> int:
        from piper_plan.runtime.accounting import optimizer_state_bytes

        return sum(optimizer_state_bytes(o) for o in self._inner())


class Trainer:
    """This rank's part of the run: stage model, schedule, dispatcher, optimizer, data, accounting."""

    def __init__(self, cfg: RunConfig, rank: int, world: int, device, lr: float = 1e-3,
                 aux_loss_coeff: float = 0.0, mesh=None) -> None:
        import torch

        from piper_plan.runtime.mesh import Mesh

        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        p = cfg.parallel
        self.mesh = mesh or Mesh.create(rank, p.pp, p.dp, p.ep)
        self.seed = int(cfg.runtime.get("seed", 0) or 0)
        torch.manual_seed(self.seed + rank)
        self.module = self._build_model(aux_loss_coeff)
        self.dense = [q for n, q in self.module.named_parameters() if ".experts." not in n]
        self.expert = [q for n, q in self.module.named_parameters() if ".experts." in n]
        self.optimizer = Optimizers([(self.dense, self.mesh.dp_group, p.dp), (self.expert, self.mesh.edp_group, p.edp)],
                                    cfg.training, lr, p.zero)
        self.schedule = None
        if p.pp > 1:
            from piper_plan.runtime.pipeline import build_schedule

            self.schedule = build_schedule(self.module, self.mesh.me.pp_index, p.pp, self.mesh.pp_group,
                                           p.schedule, p.num_microbatches, device)
        from piper_plan.runtime.accounting import SavedTensorTracker
        from piper_plan.runtime.data import make_source
        from piper_plan.runtime.pipeline import P2PTimer

        self.data = make_source(cfg.runtime.get("data"), cfg.model.vocab_size, cfg.training.seq_len, self.seed)
        self.tracker = SavedTensorTracker(self.module)
        self.p2p = P2PTimer()
        self.dp_sync_s = 0.0
        if self.schedule is not None:
            self._infer_shapes()
        from piper_plan.runtime.migration import ExpertMigrator, MigrationSettings

        self.migrator = ExpertMigrator.from_trainer(self, MigrationSettings.from_dict(cfg.migration))

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
                      "dispatcher": self._dispatcher(), "aux_loss_coeff": aux_loss_coeff}
        # StageModel, or VirtualStages (interleaved); plan.recompute applied inside (model.py)
        module = build_rank_module(spec, p, me.pp_index, moe_kwargs, self.seed)
        return module.to(self.device)

    def _dispatcher(self):
        p = self.cfg.parallel
        if p.a2a == "halo":
            from piper_plan.runtime.halo import build_halo_dispatchers
            from piper_plan.runtime.topology import topology_from_env

            node = self.cfg.platform.node
            topo = topology_from_env(self.world, node.devices_per_node, node.device_nic)
            return build_halo_dispatchers(self.mesh.ep_group_ranks, topo)
        if p.ep == 1:
            return None
        from piper_plan.runtime.dispatch import FlatDispatcher

        return FlatDispatcher(self.mesh.ep_group)

    # -- one step
    def batch(self, step: int):
        from piper_plan.runtime.data import dp_slice

        tr, p = self.cfg.training, self.cfg.parallel
        x, y = dp_slice(self.data.batch(step, tr.global_batch), self.mesh.me.dp_index, p.dp)
        return x.to(self.device), y.to(self.device)

    def forward_backward(self, step: int) -> list:
        """Zero grads, run every micro-batch of this dp rank through the pipeline; last-stage losses."""
        from piper_plan.runtime.pipeline import run_local, run_pipeline

        for q in self.module.parameters():
            q.grad = None
        x, y = self.batch(step)
        with self._autocast(), self.tracker.hooks():
            if self.schedule is None:
                return run_local(self.module, x, y, self.cfg.parallel.num_microbatches)
            return run_pipeline(self.schedule, self.module.is_first, self.module.is_last, x, y)

    def _autocast(self):
        import torch

        if self.device.type == "cuda" and self.cfg.training.dtype in ("bf16", "fp16"):
            dtype = torch.bfloat16 if self.cfg.training.dtype == "bf16" else torch.float16
            return torch.autocast("cuda", dtype=dtype)
        return contextlib.nullcontext()

    def sync_grads(self) -> None:
        """Dense grads: mean over dp. Expert grads: sum over edp, divided by dp (each expert rank already
        holds the contributions of its whole EP group's tokens)."""
        p = self.cfg.parallel
        start = time.perf_counter()
        if p.dp > 1:
            _allreduce_mean(self.dense, self.mesh.dp_group, p.dp)
        if p.edp > 1 or p.ep > 1:
            _allreduce_mean(self.expert, self.mesh.edp_group if p.edp > 1 else None, p.dp)
        self.dp_sync_s += time.perf_counter() - start

    def train_step(self, step: int) -> dict:
        """One optimizer step; returns this rank's report (gathered by rank 0)."""
        import torch
        import torch.distributed as dist

        self._reset_counters()
        start = time.perf_counter()
        losses = self.forward_backward(step)
        self.sync_grads()
        memory = self.memory_bytes()
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        loss = None
        if self.module.is_last:
            mean = torch.stack(losses).mean().detach().float()
            if self.cfg.parallel.dp > 1:
                dist.all_reduce(mean, group=self.mesh.dp_group)
                mean /= self.cfg.parallel.dp
            loss = float(mean.cpu())
        seconds = time.perf_counter() - start
        migration = self._migrate(step)
        return {"rank": self.rank, "stage": self.mesh.me.pp_index, "dp_index": self.mesh.me.dp_index,
                "loss": loss, "seconds": seconds, "memory": memory, "migration": migration,
                "time_s": {"a2a": self._a2a_seconds(), "p2p": self.p2p.seconds, "dp_sync": self.dp_sync_s,
                           "migration": migration["seconds"] if migration else 0.0},
                "expert_tokens": {i: m.expert_tokens.tolist() for i, m in self.module.moe_layers().items()}}

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
                m.dispatcher.timer.seconds = 0.0
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
        """This rank's memory: the allocator's peak on GPUs, the runtime's tensor accounting on CPU."""
        from piper_plan.runtime.accounting import tensor_bytes
        from piper_plan.runtime.metrics import MEMORY_SOURCE_CPU, MEMORY_SOURCE_GPU

        params = tensor_bytes(self.module.parameters())
        grads = tensor_bytes(q.grad for q in self.module.parameters())
        optim, acts = self.optimizer.state_bytes(), self.tracker.peak_bytes
        out = {"stage": self.mesh.me.pp_index, "parameters_bytes": params, "gradients_bytes": grads,
               "optimizer_bytes": optim, "activations_bytes": acts}
        if self.device.type == "cuda":
            import torch

            return {**out, "total_bytes": int(torch.cuda.max_memory_allocated(self.device)), "source": MEMORY_SOURCE_GPU}
        return {**out, "total_bytes": params + grads + optim + acts, "source": MEMORY_SOURCE_CPU}

    # -- checkpoints
    def save(self, run_dir: Path, step: int) -> None:
        import torch.distributed as dist

        from piper_plan.runtime.checkpoint import mark_latest, save_rank

        save_rank(run_dir, step, self.rank, self.module, self.optimizer)
        dist.barrier()
        if self.rank == 0:
            mark_latest(run_dir, step)
        dist.barrier()

    def resume(self, run_dir: Path) -> int:
        from piper_plan.runtime.checkpoint import latest_step, load_rank

        step = latest_step(run_dir)
        return 0 if step is None else load_rank(run_dir, step, self.rank, self.module, self.optimizer)


def _allreduce_mean(params, group, divisor: int, bucket_numel: int = 2**25) -> None:
    """Sum gradients over ``group`` (None: no communication) in flat buckets, then divide by ``divisor``."""
    import torch
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    for q in params:
        if q.grad is None:
            q.grad = torch.zeros_like(q)
    for bucket in _buckets([q.grad for q in params], bucket_numel):
        flat = _flatten_dense_tensors(bucket)
        if group is not None:
            dist.all_reduce(flat, group=group)
        flat /= divisor
        for g, s in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(s)


def _buckets(tensors, bucket_numel: int):
    bucket, size = [], 0
    for t in tensors:
        if bucket and size + t.numel() > bucket_numel:
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel()
    if bucket:
        yield bucket


# ---- rank-0 reporting ---------------------------------------------------------------------------
def merge_reports(reports: list[dict], step: int, tokens: int):
    """All ranks' step reports -> one metrics.jsonl record (DESIGN.md)."""
    from piper_plan.runtime.metrics import step_record

    loss = next(r["loss"] for r in reports if r["loss"] is not None)
    stages = sorted({r["stage"] for r in reports})
    memory = [max((r["memory"] for r in reports if r["stage"] == s), key=lambda m: m["total_bytes"]) for s in stages]
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
    return step_record(step, loss, seconds, tokens, time_s, memory, dict(sorted(experts.items(), key=lambda kv: int(kv[0]))),
                       migrations)


# ---- entry point --------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m piper_plan.runtime.train", description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True, help="plan.json (piper estimate/plan --save, piper launch)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: plan runtime.steps)")
    ap.add_argument("--out", default="run", help="run directory (metrics.jsonl, summary.json, checkpoints/)")
    ap.add_argument("--resume", action="store_true", help="continue from RUN_DIR/checkpoints/latest")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="record a torch profiler Chrome trace of STEPS steps after the first")
    ap.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    ap.add_argument("--aux-loss-coeff", type=float, default=0.01, help="Switch balance-loss coefficient (0 = off)")
    return ap.parse_args(argv)


class _StopFlag:
    """SIGTERM / SIGUSR1 set a flag; the loop checkpoints at the end of the step and exits 75."""

    def __init__(self) -> None:
        self.signum = 0
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._set)

    def _set(self, signum, frame) -> None:
        self.signum = signum


def main(argv=None) -> int:
    args = parse_args(argv)
    env = read_launch_env()
    rank, world, local = env.rank, env.world_size, env.local_rank
    import torch

    try:
        cfg = read_plan(args.plan)
        preflight(cfg, world, torch.cuda.is_available())
    except PiperError as exc:
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    return run(cfg, args, rank, world, local)


def _init(cfg, rank: int, world: int, local: int):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if cfg.platform.launch.device == "cuda":
        index = device_index(local, torch.cuda.device_count())
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if not dist.is_initialized():
        backend = cfg.platform.launch.backend if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world)
    return device


def run(cfg: RunConfig, args, rank: int, world: int, local: int) -> int:
    import torch.distributed as dist

    from piper_plan.fileio import atomic_write_json
    from piper_plan.runtime.metrics import MetricsWriter, summarise

    device = _init(cfg, rank, world, local)
    stop = _StopFlag()
    trainer = Trainer(cfg, rank, world, device, lr=args.lr, aux_loss_coeff=args.aux_loss_coeff)
    run_dir = Path(args.out)
    start = trainer.resume(run_dir) if args.resume else 0
    steps = args.steps or int(cfg.runtime.get("steps") or 10)
    interval = int(cfg.runtime.get("checkpoint_interval") or 0)
    tokens = cfg.training.global_batch * cfg.training.seq_len
    records = _kept_records(run_dir / "metrics.jsonl", start) if rank == 0 and args.resume else []
    writer = MetricsWriter(run_dir / "metrics.jsonl", resume=False) if rank == 0 else None
    if rank == 0:
        _keep_plan(Path(args.plan), run_dir)
    for r in records:
        writer.write(r)
    code = 0
    for step in range(start, steps):
        with _profiler(args.profile, step - start, run_dir, rank) as _:
            report = trainer.train_step(step)
        gathered = [None] * world
        dist.all_gather_object(gathered, report)
        if rank == 0:
            records.append(merge_reports(gathered, step + 1, tokens))
            writer.write(records[-1])
        saved = bool(interval) and (step + 1) % interval == 0
        if saved:
            trainer.save(run_dir, step + 1)
        if _stop_requested(stop, device):
            if not saved:
                trainer.save(run_dir, step + 1)
            code = EXIT_REQUEUE
            break
    if rank == 0:
        writer.close()
        atomic_write_json(run_dir / "summary.json", {**summarise(records), "exit_code": code,
                                                     "world": world, "device": device.type})
    dist.barrier()
    dist.destroy_process_group()
    return code


def _keep_plan(plan_path: Path, run_dir: Path) -> None:
    """A copy of the plan beside metrics.jsonl, so that `piper compare RUN_DIR` finds the prediction."""
    from piper_plan.fileio import atomic_write_text

    target = run_dir / "plan.json"
    if not target.exists():
        atomic_write_text(target, plan_path.read_text(encoding="utf-8"))


def _kept_records(path: Path, start: int) -> list[dict]:
    """metrics.jsonl lines of steps <= start (a run killed after its last checkpoint logged steps it will redo)."""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["step"] <= start]


def _stop_requested(stop: _StopFlag, device) -> bool:
    """Any rank signalled -> every rank stops (one all-reduce of a flag)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if stop.signum else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


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
    sys.exit(main())
