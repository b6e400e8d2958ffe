"""Framework-overhead sweep (torch, imported lazily): the runtime's own modules at a width where FLOPs vanish.

What the FLOP / byte / collective model cannot see is the fixed cost of every operator (Python, autograd,
dispatch). Each row times one piece of the runtime (piper_plan/runtime/model.py, moe.py, pipeline.py) forward +
backward, under the runtime's saved-tensor accounting hooks as the runtime runs it, at hidden 16, 32 tokens, so that its GEMMs cost microseconds and what remains is overhead:
attention_layer, dense_mlp, moe_block at 1, 2, 4, 8, 16 local experts, the attention layer's and the 4-expert MoE
block's forward alone (what full recompute runs again), head_loss (vocab 32), optimizer_tensor (AdamW
over 8 and 32 tensors of 16 elements), autograd_op (one elementwise op, forward + backward: a reference figure),
and concurrency: the moe_block workload (4 local experts) run by 1, 2 and 4 gloo ranks in lockstep, a tiny
all_reduce after each call (mean seconds per iteration, the all_reduce's own cost subtracted), which says how much
the host's other load, ranks sharing its cores, and waiting for a preempted peer slow a rank down. The block rows
are the fastest sample (the piece's own cost); the concurrency rows hold the slowdown. concurrency_coarse repeats
that with 3 workloads per all_reduce: per iteration g x w x slowdown + wait, so the two give both. Both are
measured by the same processes in alternating rounds: measured one after the other, a change of the host's load
between them moved the excess from wait to slowdown or back (docs/closed-loop.md). Rows go to overhead.csv
(calibration/overhead.py).

``--launched-ranks``: run as each of the ranks a launcher started (torchrun, scripts/netemu.sh run), only the
lockstep rows of that rank count, plus the workload and a small all_to_all after it timed apart (lockstep_outside,
lockstep_wait: where the runtime's timers put the wait).

Run: ``piper calibrate overhead --platform local-cpu`` or ``python -m piper_plan.calibration.bench_overhead --out DIR``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from datetime import datetime, timedelta, timezone

from piper_plan.calibration.timing import device_name
from piper_plan.runtime.mesh import end_process_group

HIDDEN, TOKENS, VOCAB, FFN = 16, 32, 32, 16
MOE_LOCAL_EXPERTS = (1, 2, 4, 8, 16)
OPTIMIZER_TENSORS = (8, 32)
CONCURRENCY_RANKS = (1, 2, 4)
CONCURRENCY_WORKLOAD_EXPERTS = 4      # overhead.py reads the slowdown against this moe_block row
FORWARD_EXPERTS = 4                   # the moe_block_forward row's local experts
COARSE_CALLS = 3                       # workloads per collective in the concurrency_coarse rows


def probe_spec(num_experts: int = 4):
    """A one-layer MoE ModelSpec of the runtime's main structure (GQA, gated experts, top-2 softmax)."""
    from piper_plan.specs import ModelSpec

    return ModelSpec.model_validate({
        "name": "overhead-probe", "source": "piper calibrate overhead probe (not a model)", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "num_layers": 1, "max_seq_len": TOKENS,
        "attention": {"kind": "gqa", "num_heads": 2, "num_kv_heads": 1},
        "dense_ffn": {"intermediate_size": FFN, "gated": True},
        "moe": {"num_experts": num_experts, "top_k": min(2, num_experts),
                "expert": {"intermediate_size": FFN, "gated": True}}})


def _runtime_context(device, tracker):
    """What train.Trainer.forward_backward wraps a micro-batch in on ``device``: on a CPU the saved-tensor
    accounting (its Python pack/unpack hooks roughly double a small layer's fixed cost there); on a GPU bf16
    autocast and the step's weight casts (runtime/casts.py: a probe call casts as a step's first micro-batch)."""
    import contextlib

    import torch

    if device.type == "cpu":
        return tracker.hooks()
    from piper_plan.runtime.casts import casts_once_per_step

    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
    stack.enter_context(casts_once_per_step())
    return stack


def _fwd_bwd(module_fn, x, tracker, device):
    """Forward + backward as train.Trainer.forward_backward runs every micro-batch (``_runtime_context``)."""
    def call():
        x.grad = None
        with _runtime_context(device, tracker):
            out = module_fn(x).float().sum()
        out.backward()
    return call


def _fwd(module_fn, x, tracker, device):
    """The forward of ``_fwd_bwd`` alone, recording its graph as a recomputed forward does."""
    def call():
        with _runtime_context(device, tracker):
            module_fn(x)
    return call


def block_calls(device=None) -> dict[tuple[str, int], object]:
    """(op, size) -> a zero-argument call running that piece forward + backward once on ``device`` (the CPU by
    default)."""
    import torch

    from piper_plan.runtime.model import Attention, make_norm
    from piper_plan.runtime.moe import FFN as DenseFFN, MoE
    from piper_plan.runtime.pipeline import lm_loss

    from piper_plan.runtime.accounting import SavedTensorTracker

    device = device or torch.device("cpu")
    spec = probe_spec()
    x = torch.randn(1, TOKENS, HIDDEN, requires_grad=True, device=device)
    norm, attn, mlp = (m.to(device) for m in (make_norm(spec.norm, HIDDEN), Attention(spec),
                                               DenseFFN(HIDDEN, spec.dense_ffn)))
    tracker = SavedTensorTracker(torch.nn.ModuleList([norm, attn, mlp]))
    calls = {("attention_layer", 1): _fwd_bwd(lambda h: h + attn(norm(h)), x, tracker, device),
             ("dense_mlp", 1): _fwd_bwd(lambda h: h + mlp(norm(h)), x, tracker, device)}
    for e in MOE_LOCAL_EXPERTS:
        moe = MoE(HIDDEN, probe_spec(e).moe).to(device)
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.02)
        calls[("moe_block", e)] = _fwd_bwd(lambda h, m=moe: h + m(norm(h)), x, tracker, device)
        if e == FORWARD_EXPERTS:                # the forward alone: what full recompute runs again
            calls[("moe_block_forward", e)] = _fwd(lambda h, m=moe: h + m(norm(h)), x, tracker, device)
    calls[("attention_layer_forward", 1)] = _fwd(lambda h: h + attn(norm(h)), x, tracker, device)
    embed, head = torch.nn.Embedding(VOCAB, HIDDEN).to(device), torch.nn.Linear(HIDDEN, VOCAB, bias=False).to(device)
    tokens, targets = (torch.randint(0, VOCAB, (1, TOKENS), device=device) for _ in range(2))

    def head_loss():
        with _runtime_context(device, tracker):
            loss = lm_loss(head(norm(embed(tokens))).float(), targets)
        loss.backward()
    calls[("head_loss", 1)] = head_loss
    for n in OPTIMIZER_TENSORS:
        calls[("optimizer_tensor", n)] = _optimizer_call(n, device)
    calls[("autograd_op", 1)] = _autograd_op_call(device=device)
    return calls


def _optimizer_call(num_tensors: int, device):
    import torch

    params = [torch.nn.Parameter(torch.randn(HIDDEN, device=device)) for _ in range(num_tensors)]
    for p in params:
        p.grad = torch.randn(HIDDEN, device=device)
    from piper_plan.runtime.optim import adamw_options

    return torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0, **adamw_options(device)).step   # the runtime's


def _autograd_op_call(chain: int = 100, device=None):
    """One elementwise op forward + backward: a chain of ``chain`` multiplications, per op (divided later)."""
    import torch

    a = torch.ones(4, requires_grad=True, device=device)

    def call():
        z = a
        for _ in range(chain):
            z = z * 1.0001
        z.sum().backward()
    call.per_call = chain
    return call


def min_seconds(call, warmup: int = 3, repeats: int = 15, min_sample_s: float = 2e-3, device=None) -> float:
    """The fastest of ``repeats`` samples (each ``inner`` calls lasting >= min_sample_s), per call: the cost of the
    piece itself. On a shared machine a median mixes in other processes' load; that load is measured apart, by
    the concurrency rows (a per-rank median while ranks run at once). On a GPU a sample ends when the device has
    run its calls (timing._sync): at this width its kernels take microseconds, and the time is the host's."""
    from piper_plan.calibration.timing import _sync

    def sync():
        if device is not None:
            _sync(device)
    for _ in range(warmup):
        call()
    sync()
    t0 = time.perf_counter()
    call()
    sync()
    inner = max(1, min(1000, int(min_sample_s / max(time.perf_counter() - t0, 1e-9)) + 1))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            call()
        sync()
        samples.append((time.perf_counter() - t0) / inner)
    return min(samples)


def measure_blocks(repeats: int = 15, warmup: int = 3, device=None) -> dict[tuple[str, int], float]:
    """Seconds per call of every piece (min over samples), in this process (one thread) on ``device``."""
    import torch

    torch.set_num_threads(1)
    out = {}
    for key, call in block_calls(device).items():
        out[key] = min_seconds(call, warmup, repeats, device=device) / getattr(call, "per_call", 1)
    return out


def _concurrency_worker(rank: int, world: int, port: int, queue, iterations: int, rounds: int = 10) -> None:
    """One rank: iterations of ``g`` moe_block workloads then a 4-byte all_reduce (gloo, as the runtime's
    collectives), for g = 1 and g = COARSE_CALLS in alternating rounds, so that both see the same load; puts
    {g: mean seconds per iteration less the mean seconds of the all_reduce alone}."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    queue.put(_lockstep_seconds(iterations, rounds))
    end_process_group()


def _lockstep_seconds(iterations: int, rounds: int = 10) -> dict[int, float]:
    """In an initialised gloo group: {g: mean seconds per iteration of g moe_block workloads then a 4-byte
    all_reduce, less the all_reduce alone}, g = 1 and COARSE_CALLS in alternating rounds."""
    import torch
    import torch.distributed as dist

    call, flag = block_calls()[("moe_block", CONCURRENCY_WORKLOAD_EXPERTS)], torch.zeros(1)
    sync_alone = _mean_seconds(lambda: dist.all_reduce(flag), 200)
    for _ in range(3):
        call()
    dist.barrier()
    spent = {g: [0.0, 0] for g in (1, COARSE_CALLS)}
    for _ in range(rounds):
        for g, acc in spent.items():
            n = max(1, iterations // (rounds * g))
            acc[0] += n * _mean_seconds(lambda g=g: ([call() for _ in range(g)], dist.all_reduce(flag)), n)
            acc[1] += n
    return {g: max(total / n - sync_alone, 1e-9) for g, (total, n) in spent.items()}


WAIT_EXCHANGE_FLOATS_PER_PEER = 64   # the small exchange whose wait the split lockstep rows time (not its bytes)


def _split_lockstep_seconds(iterations: int, repeats: int = 10) -> tuple[float, float]:
    """In an initialised gloo group, one moe_block workload then a small all_to_all_single (the runtime's MoE
    exchange), timed apart as the runtime's timers time them: (mean seconds outside the exchange per workload,
    mean seconds inside it less the fastest of ``repeats`` exchanges alone: the wait for the peers)."""
    import torch
    import torch.distributed as dist

    call = block_calls()[("moe_block", CONCURRENCY_WORKLOAD_EXPERTS)]
    send = torch.zeros(WAIT_EXCHANGE_FLOATS_PER_PEER * dist.get_world_size())   # divides evenly for any world
    recv = torch.empty_like(send)

    def exchange():
        dist.all_to_all_single(recv, send)
    alone = min(_mean_seconds(exchange, 1) for _ in range(repeats))
    for _ in range(3):
        call()
        exchange()
    dist.barrier()
    outside = inside = 0.0
    for _ in range(iterations):
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        exchange()
        outside, inside = outside + t1 - t0, inside + time.perf_counter() - t1
    return outside / iterations, max(inside / iterations - alone, 1e-9)   # overhead.csv rows are > 0


def lockstep_on_launched_ranks(out: str, iterations: int = 1000) -> None:
    """The lockstep rows for the ranks a launcher started (RANK, WORLD_SIZE, MASTER_ADDR / PORT in the
    environment: e.g. scripts/netemu.sh run, ranks in the emulated nodes' namespaces, so the collectives cross
    the emulated network): every rank measures, rank 0 merges the mean over ranks as the rows of size WORLD_SIZE
    into ``out``/overhead.csv: concurrency and concurrency_coarse, and lockstep_outside / lockstep_wait (the
    workload and the exchange timed apart: calibration/overhead.py prefers them)."""
    import torch
    import torch.distributed as dist

    from piper_plan.calibration.io import merge_rows
    from piper_plan.calibration.overhead import OVERHEAD

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))   # a missing peer ends it, not gloo's 30 min
    try:
        values = [None] * dist.get_world_size()
        mine = _lockstep_seconds(iterations)
        mine["outside"], mine["wait"] = _split_lockstep_seconds(max(iterations // 2, 1))
        dist.all_gather_object(values, mine)
        if dist.get_rank() == 0:
            when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M")
            source = (f"measured: python -m piper_plan.calibration.bench_overhead --launched-ranks, {len(values)} "
                      f"launched ranks ({os.environ.get('PIPER_EMULATE_TOPOLOGY', '?')}) on {socket.gethostname()} "
                      f"{when}")
            rows = [{"op": op, "size": len(values), "seconds": statistics.mean(v[g] for v in values),
                     "source": source} for op, g in (("concurrency", 1), ("concurrency_coarse", COARSE_CALLS),
                                                     ("lockstep_outside", "outside"), ("lockstep_wait", "wait"))]
            print(merge_rows(out, OVERHEAD, rows))
            for r in rows:
                print(f"{r['op']:18s} {r['size']:3d} {r['seconds'] * 1e6:10.1f} us")
    finally:
        end_process_group()


def _mean_seconds(fn, iterations: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - t0) / iterations


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_concurrency(ranks=CONCURRENCY_RANKS, iterations: int = 1000) -> dict[int, dict[int, float]]:
    """ranks -> {g: mean seconds per iteration (over ranks)} when ``ranks`` gloo ranks run g moe_block workloads
    and a 4-byte all_reduce in lockstep (its own cost subtracted), g = 1 and COARSE_CALLS: the runtime's pattern
    of ~1 ms of work between blocking collectives. Against the workload's own time this is the slowdown a rank
    sees from the host's other load and from ranks sharing its cores, plus the wait for the rank that was
    preempted (a rank computing when another waits); the two g separate them (calibration/overhead.py). ~1000
    workloads per g: long beside the scheduler's time slices."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = {}
    for n in ranks:
        queue, port = ctx.Queue(), _free_port()
        procs = [ctx.Process(target=_concurrency_worker, args=(r, n, port, queue, iterations)) for r in range(n)]
        for p in procs:
            p.start()
        values = [queue.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
        out[n] = {g: statistics.mean(v[g] for v in values) for g in values[0]}
    return out


def overhead_rows(command: str, concurrency: bool = True, device=None) -> list[dict]:
    """Measure everything; rows of overhead.csv. On a GPU (``device`` cuda) the pieces only: the concurrency rows
    time CPU ranks sharing a host's cores, which GPU ranks do not."""
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M")
    on = f" ({device_name(device)})" if device is not None and device.type != "cpu" else ""
    source = f"measured: {command} on {socket.gethostname()}{on} {when}"
    rows = [{"op": op, "size": size, "seconds": s, "source": source}
            for (op, size), s in measure_blocks(device=device).items()]
    # one workload per collective, and three: separates the slowdown from the wait per sync
    if concurrency and (device is None or device.type == "cpu"):
        for n, by_calls in measure_concurrency().items():
            rows += [{"op": "concurrency", "size": n, "seconds": by_calls[1], "source": source},
                     {"op": "concurrency_coarse", "size": n, "seconds": by_calls[COARSE_CALLS], "source": source}]
    return rows


def main(argv=None) -> int:
    from piper_plan.calibration.io import merge_rows
    from piper_plan.calibration.overhead import OVERHEAD

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="calibration directory (overhead.csv is merged into it)")
    ap.add_argument("--no-concurrency", action="store_true", help="skip the multi-process rows")
    ap.add_argument("--launched-ranks", action="store_true",
                    help="only the lockstep rows, as one of the ranks a launcher started (RANK, WORLD_SIZE, ...)")
    ap.add_argument("--iterations", type=int, default=1000, help="lockstep iterations per rank count")
    args = ap.parse_args(argv)
    if args.iterations < 1:
        ap.error(f"--iterations {args.iterations}: at least 1")
    if args.launched_ranks:
        lockstep_on_launched_ranks(args.out, args.iterations)
        return 0
    rows = overhead_rows("python -m piper_plan.calibration.bench_overhead", not args.no_concurrency)
    print(merge_rows(args.out, OVERHEAD, rows))
    for r in rows:
        print(f"{r['op']:18s} {r['size']:3d} {r['seconds'] * 1e6:10.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
