"""Orchestration of ``piper calibrate``: the GEMM and attention sweeps in this process, the collective
sweep in a distributed environment (or a local gloo group this module spawns), resume, metadata.

Rows reach the CSVs in small batches through atomic merges, so an interrupted sweep keeps what it measured
and never leaves a truncated file; ``resume`` skips points already in the CSVs.
"""

from __future__ import annotations

import json
import os
import platform as pyplatform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from piper_plan.errors import PiperError
from piper_plan.launchenv import exit_text

KINDS = ("gemm", "attention", "collectives", "memory")
DEVICE_KINDS = ("gemm", "attention", "memory")
"""The sweeps one process runs on its device (the collectives need a group of ranks)."""
LOCAL_NODES = 2
"""Emulated nodes of the local gloo group (ranks = LOCAL_NODES x the platform's devices_per_node)."""
RANK_POLL_S = 0.1
"""How often the local collective sweep looks at its ranks (a rank that fails stops the others within this)."""
_FLUSH_EVERY = 5


class Reporter:
    """Progress sink; the CLI passes a rich progress bar, tests the silent default."""

    def start(self, task: str, total: int) -> None: ...

    def advance(self, task: str, label: str, done: int | None = None) -> None: ...

    def say(self, text: str) -> None: ...


@dataclass(frozen=True)
class SweepOptions:
    platform: str
    out_dir: Path
    quick: bool = False
    resume: bool = False
    only: tuple[str, ...] = KINDS
    dtypes: tuple[str, ...] | None = None
    """The GEMM and attention sweeps measure only these precisions (None: every one the device's sweep has)."""
    command: str = "piper calibrate"
    collective_timeout_s: float = 1800.0


@dataclass
class SweepResult:
    rows_written: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)


def parse_only(text: str | None) -> tuple[str, ...]:
    if text is None:
        return KINDS
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        what = f"unknown {bad}" if bad else "names nothing"
        raise PiperError(f"--only {text!r}: {what}; allowed a comma list of {list(KINDS)}")
    return kinds


def parse_dtypes(text: str | None) -> tuple[str, ...] | None:
    """``--dtype bf16,fp32`` as a tuple (None: every precision the sweep has); checked against the device later."""
    if text is None:
        return None
    dtypes = tuple(dict.fromkeys(d.strip() for d in text.split(",") if d.strip()))
    if not dtypes:
        raise PiperError(f"--dtype {text!r} names nothing; allowed a comma list of the precisions the sweep measures")
    return dtypes


def _device_points(kind: str, device_type: str, quick: bool) -> list:
    """Every GEMM or attention point of the sweep on a ``device_type`` device."""
    from piper_plan.calibration.bench_attention import attention_points
    from piper_plan.calibration.bench_gemm import gemm_points

    return (gemm_points if kind == "gemm" else attention_points)(device_type, quick)


def compute_points(kind: str, device_type: str, opts: SweepOptions) -> list:
    """The GEMM or attention points the sweep measures on a ``device_type`` device, kept to ``opts.dtypes``."""
    return [p for p in _device_points(kind, device_type, opts.quick) if opts.dtypes is None or p.dtype in opts.dtypes]


def check_dtypes(opts: SweepOptions, device_type: str) -> list[str]:
    """Every ``--dtype`` is measured by at least one selected GEMM or attention sweep on this device type; returns
    a message for each selected sweep that measures none of them."""
    if opts.dtypes is None:
        return []
    kinds = [k for k in ("gemm", "attention") if k in opts.only]
    if not kinds:
        raise PiperError(f"--dtype {','.join(opts.dtypes)}: only the gemm and attention sweeps have a precision; "
                         f"--only {','.join(opts.only)} selects neither")
    by_kind = {k: list(dict.fromkeys(p.dtype for p in _device_points(k, device_type, opts.quick))) for k in kinds}
    bad = [d for d in opts.dtypes if not any(d in dtypes for dtypes in by_kind.values())]
    if bad:
        each = "; ".join(f"{kind} {', '.join(dtypes)}" for kind, dtypes in by_kind.items())
        raise PiperError(f"--dtype {','.join(bad)}: on a {device_type} device the sweeps measure: {each}")
    return [f"{kind}: nothing measured, its sweep on a {device_type} device has no {','.join(opts.dtypes)} point "
            f"(it measures {', '.join(dict.fromkeys(p.dtype for p in _device_points(kind, device_type, opts.quick)))})"
            for kind in kinds if not compute_points(kind, device_type, opts)]


def check_fp8_peak(opts: SweepOptions, platform) -> None:
    """``--dtype fp8`` on a platform whose device has no fp8 peak (MI250X, A100) is one line before anything is
    measured or a job script written."""
    if opts.dtypes is not None and "fp8" in opts.dtypes and "fp8" not in platform.device.peak_flops:
        raise PiperError(f"--dtype fp8: platform {platform.name}'s device has no 8-bit GEMMs (device.peak_flops has "
                         f"{', '.join(platform.device.peak_flops)})")


def check_existing_files(out_dir: Path, kinds: tuple[str, ...]) -> None:
    """The CSVs the sweep will merge into (and metadata.json) read as they are before anything is measured: a
    malformed one is one error line before minutes of measurement, not after them (their rows then lost)."""
    from piper_plan.calibration.io import read_if_present, read_metadata
    from piper_plan.calibration.schema import TABLES

    for kind in kinds:
        read_if_present(out_dir, TABLES[kind])
    read_metadata(out_dir)


def run_calibration(opts: SweepOptions, reporter: Reporter | None = None) -> SweepResult:
    """Run the selected sweeps and write calibration/<platform>/; returns counts and timings."""
    from piper_plan.catalog import load_platform

    reporter = reporter or Reporter()
    platform = load_platform(opts.platform)
    skipped = check_dtypes(opts, platform.launch.device)
    check_fp8_peak(opts, platform)
    check_existing_files(opts.out_dir, opts.only)
    result = SweepResult(messages=skipped)
    source = f"measured: {opts.command} on {socket.gethostname()} {_today()}"
    if any(k in opts.only for k in DEVICE_KINDS):
        _compute_sweeps(opts, platform, source, reporter, result)
    if "collectives" in opts.only:
        _collective_sweep(opts, platform, source, reporter, result)
    if any(result.rows_written.values()):   # a run that wrote nothing leaves the folder (and its seed record) as is
        _write_run_metadata(opts, platform, result)
    return result


# ------------------------------------------------------------------------------ GEMM and attention


def _compute_sweeps(opts, platform, source, reporter, result) -> None:
    import torch

    from piper_plan.calibration.timing import cpu_isa_flags, device_name

    torch.set_num_threads(1)  # one CPU rank = one core of this machine (platforms/local-cpu.yaml)
    if platform.launch.device == "cuda" and not torch.cuda.is_available():
        raise PiperError(f"platform {platform.name} has launch.device=cuda but torch sees no GPU here; run on a compute "
                         f"node, or --only collectives / a CPU platform (local-cpu)")
    device = torch.device("cuda", 0) if platform.launch.device == "cuda" else torch.device("cpu")
    name = device_name(device)
    isa = cpu_isa_flags() if device.type == "cpu" else None
    check_same_device(opts.out_dir, name, isa)
    if "gemm" in opts.only:
        _sweep_gemm(opts, platform, device, name, source, reporter, result)
    if "attention" in opts.only:
        _sweep_attention(opts, device, name, source, reporter, result)
    if "memory" in opts.only:
        _sweep_memory(opts, device, name, source, reporter, result)
    _device_metadata(opts.out_dir, device, name, isa, platform)


def check_same_device(out_dir: Path, name: str, isa_flags: str | None = None) -> None:
    """Refuse, before anything is measured, to add this device's rows to a folder holding another device's (its
    metadata.json): `piper calibrate --platform local-cpu` on another CPU mixed both machines' GEMM rows and
    rewrote the folder's device as if all were this one's. A CPU of the same name with other instruction sets
    (both recorded: ``isa_flags``) is another device too. A seed's device (``kind: seed``: calibration/frontier,
    named as its platform file names it, not as torch does) is replaced by a measurement of the same chip
    (io.same_device_name), and refused for another."""
    from piper_plan.calibration.io import read_metadata, recorded_device, same_device_name

    held = recorded_device(read_metadata(out_dir) if out_dir.is_dir() else {}, out_dir)
    advice = ("their rows would mix; measure into a folder of its own (--out-dir, or a copy of the platform file "
              "under another name), or move this one aside to replace it")
    if held.get("kind") == "seed":      # published numbers, which a measurement of that device replaces (merge_rows)
        if held.get("name") and not same_device_name(held["name"], name):
            raise PiperError(f"holds seed rows of {held['name']!r} and this machine's device is {name!r}: {advice}",
                             path=str(out_dir))
        return
    if held.get("name") and held["name"] != name:
        raise PiperError(f"holds the calibration of {held['name']!r} and this machine's device is {name!r}: {advice}",
                         path=str(out_dir))
    if held.get("isa_flags") and isa_flags and held["isa_flags"] != isa_flags:
        raise PiperError(f"holds the calibration of a {name!r} with instruction sets {held['isa_flags']!r}, and this "
                         f"machine's has {isa_flags!r}: another machine; {advice}", path=str(out_dir))


def _repeats(quick: bool) -> tuple[int, int]:
    return (5, 2) if quick else (20, 5)


def _pending(task: str, table, points: list, name: str, opts, result) -> list:
    """The points not yet in ``table``'s CSV when resuming (all otherwise); counts the others as skipped."""
    from piper_plan.calibration.io import measured_keys

    done = measured_keys(opts.out_dir, table) if opts.resume else set()
    todo = [p for p in points if p.key(name) not in done]
    result.skipped[task] = len(points) - len(todo)
    return todo


def _sweep_gemm(opts, platform, device, name, source, reporter, result) -> None:
    from piper_plan.calibration.bench_gemm import measure_gemm
    from piper_plan.calibration.schema import GEMM, gemm_flops

    todo = _pending("gemm", GEMM, _runnable_gemm_points(opts, platform, device, name, result), name, opts, result)
    repeats, warmup = _repeats(opts.quick)

    def measure(p):
        seconds, _how = measure_gemm(p, device, repeats, warmup)
        return {"device": name, "dtype": p.dtype, "m": p.m, "n": p.n, "k": p.k, "groups": p.groups,
                "seconds": seconds, "tflops": gemm_flops(p.m, p.n, p.k, p.groups) / seconds / 1e12, "source": source}

    _measure_all("gemm", GEMM, todo, measure, opts, reporter, result)


def _runnable_gemm_points(opts, platform, device, name: str, result) -> list:
    """The GEMM points of this sweep less fp8's where the device has no 8-bit GEMM (none in the platform's
    device.peak_flops, or torch cannot run one here): asked for with --dtype, that is one error line before anything
    is measured (check_fp8_peak refused the first case earlier); by default, a message says fp8 was not measured."""
    from piper_plan.calibration.bench_gemm import fp8_gemm_error

    points = compute_points("gemm", device.type, opts)
    if not any(p.dtype == "fp8" for p in points):
        return points
    if "fp8" not in platform.device.peak_flops:
        why = f"platform {platform.name} has no fp8 peak in device.peak_flops"
    else:
        error = fp8_gemm_error(device)
        if error is None:
            return points
        why = f"this torch runs no fp8 GEMM on it (torch._scaled_mm: {error})"
    if opts.dtypes is not None:
        others = dict.fromkeys(p.dtype for p in _device_points("gemm", device.type, opts.quick) if p.dtype != "fp8")
        raise PiperError(f"--dtype fp8: not measurable on {name}: {why}; allowed here: {', '.join(others)}")
    result.messages.append(f"gemm: fp8 not measured on {name}: {why}")
    return [p for p in points if p.dtype != "fp8"]


def _sweep_attention(opts, device, name, source, reporter, result) -> None:
    from piper_plan.calibration.bench_attention import measure_attention
    from piper_plan.calibration.schema import ATTENTION, attention_flops

    todo = _pending("attention", ATTENTION, compute_points("attention", device.type, opts), name, opts, result)
    repeats, warmup = _repeats(opts.quick)

    def measure(p):
        seconds = measure_attention(p, device, repeats, warmup)
        flops = float(attention_flops(p.batch, p.seq_len, p.num_heads, p.head_dim, p.causal, p.pass_))
        return {"device": name, "dtype": p.dtype, "pass": p.pass_, "batch": p.batch, "seq_len": p.seq_len,
                "num_heads": p.num_heads, "num_kv_heads": p.num_heads, "head_dim": p.head_dim, "causal": p.causal,
                "seconds": seconds, "tflops": flops / seconds / 1e12, "source": source}

    _measure_all("attention", ATTENTION, todo, measure, opts, reporter, result)


def _sweep_memory(opts, device, name, source, reporter, result) -> None:
    from piper_plan.calibration.bench_memory import bytes_moved, measure_memory, memory_points
    from piper_plan.calibration.schema import MEMORY

    todo = _pending("memory", MEMORY, memory_points(device.type, opts.quick), name, opts, result)
    repeats, warmup = _repeats(opts.quick)

    def measure(p):
        seconds, nbytes = measure_memory(p, device, repeats, warmup), bytes_moved(p, device.type)
        return {"device": name, "kernel": p.kernel, "elements": p.elements, "bytes": nbytes, "seconds": seconds,
                "GBps": nbytes / seconds / 1e9, "source": source}

    _measure_all("memory", MEMORY, todo, measure, opts, reporter, result)


def _measure_all(task, table, todo, measure, opts, reporter, result) -> None:
    """Measure each point; merge rows every few points and on any exit (an interrupt keeps them)."""
    from piper_plan.calibration.io import merge_rows

    t0, pending, written = time.perf_counter(), [], 0
    reporter.start(task, len(todo))
    try:
        for p in todo:
            pending.append(measure(p))
            reporter.advance(task, p.label)
            if len(pending) >= _FLUSH_EVERY:
                merge_rows(opts.out_dir, table, pending)
                written, pending = written + len(pending), []
    finally:
        if pending:
            merge_rows(opts.out_dir, table, pending)
            written += len(pending)
        result.rows_written[task] = written
        result.seconds[task] = round(time.perf_counter() - t0, 2)


def _device_metadata(out_dir: Path, device, name: str, isa_flags: str | None, platform) -> None:
    """Facts for the platform file: memory per rank, copy bandwidth (measured here), device name (and a CPU's
    instruction sets: ``compare`` and the next calibration tell this machine from others by them)."""
    from piper_plan.calibration.io import write_metadata

    facts = {"name": name, "type": device.type, "copy_bandwidth_GBps": round(_copy_bandwidth_GBps(device), 2)}
    if device.type == "cpu":
        if isa_flags:
            facts["isa_flags"] = isa_flags
        facts["memory_bytes_per_rank"] = _mem_total_bytes() // platform.node.devices_per_node
        facts["ranks_per_node"] = platform.node.devices_per_node
    else:
        import torch

        facts["memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    write_metadata(out_dir, {"device": facts})


def _copy_bandwidth_GBps(device, size_bytes: int = 256 * 2**20) -> float:
    """STREAM-copy style: bytes read + written by one ``dst.copy_(src)`` of ``size_bytes``, per second."""
    import torch

    from piper_plan.calibration.timing import median_seconds

    src = torch.empty(size_bytes // 4, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, warmup=2, repeats=5)
    return 2 * size_bytes / seconds / 1e9


def _mem_total_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024  # kB (KiB) -> bytes
    raise PiperError("cannot read MemTotal from /proc/meminfo")


# ------------------------------------------------------------------------------ collectives


def _collective_sweep(opts, platform, source, reporter, result) -> None:
    from piper_plan.calibration import bench_collectives as bc

    env = bc.dist_env()
    t0 = time.perf_counter()
    if env is not None:
        meta = bc.run(env, platform, str(opts.out_dir), opts.quick, opts.resume, bc.OPS_MEASURED, source)
        if env.rank == 0:
            _merge_meta(opts.out_dir, {"collectives": meta})
            result.skipped["collectives"] = meta["skipped"]
    elif platform.launch.backend == "gloo":
        result.rows_written["collectives"], result.skipped["collectives"] = spawn_local_sweep(opts, platform, source,
                                                                                               reporter)
    else:
        result.messages.append(launch_hint(platform.name))
        return
    result.seconds["collectives"] = round(time.perf_counter() - t0, 2)


def launch_hint(platform: str) -> str:
    return (f"collectives skipped: no distributed environment (RANK/WORLD_SIZE or SLURM_PROCID/SLURM_NTASKS) and "
            f"platform {platform} uses nccl. Across real nodes run `piper calibrate slurm --platform {platform} "
            f"--nodes N --submit`, or inside an allocation `srun -N N -n <ranks> python -m "
            f"piper_plan.calibration.bench_collectives --platform {platform} --out calibration/{platform}`.")


def spawn_local_sweep(opts, platform, source, reporter) -> tuple[int, int]:
    """Run bench_collectives as LOCAL_NODES x devices_per_node local processes over gloo (emulated nodes);
    returns the number of points measured and of those skipped as already measured (--resume)."""
    per_node = platform.node.devices_per_node
    world = LOCAL_NODES * per_node
    args = [sys.executable, "-m", "piper_plan.calibration.bench_collectives", "--platform", opts.platform,
            "--out", str(opts.out_dir), "--source", source] + (["--quick"] if opts.quick else []) + (["--resume"] if opts.resume else [])
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(per_node), "PIPER_EMULATE_TOPOLOGY": f"{LOCAL_NODES}x{per_node}",
            "OMP_NUM_THREADS": "1", "PIPER_PROGRESS_PIPE": "1"}
    with tempfile.TemporaryDirectory(prefix="piper-calib-") as logs:
        procs = [_start_rank(args, base, r, per_node, Path(logs)) for r in range(world)]
        counter = {"measured": 0, "skipped": 0}
        follower = threading.Thread(target=_follow_progress, args=(procs[0], reporter, counter), daemon=True)
        follower.start()
        try:
            codes = _wait_ranks(procs, opts.collective_timeout_s)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        follower.join(timeout=5)
        failed = [r for r, c in enumerate(codes) if c not in (0, None)]
        if failed:
            tails = "; ".join(f"rank {r}: {exit_text(codes[r])}: {_tail(Path(logs) / f'rank{r}.err')}" for r in failed)
            raise PiperError(f"local collective sweep failed ({len(failed)} of {world} ranks; the others were "
                             f"stopped): {tails}")
        if any(c is None for c in codes):
            raise PiperError(f"local collective sweep: no result after {opts.collective_timeout_s:.0f} s; "
                             f"its {world} ranks were stopped")
    return counter["measured"], counter["skipped"]


def _wait_ranks(procs: list[subprocess.Popen], timeout_s: float) -> list[int | None]:
    """Every rank's exit code; as soon as one fails, or at the deadline, the others are stopped (they would wait
    for it in a collective or the rendezvous until gloo's 30 minutes), and theirs are None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes) or any(c not in (0, None) for c in codes):
            return codes
        time.sleep(RANK_POLL_S)
    return [p.poll() for p in procs]


def _start_rank(args, base, rank: int, per_node: int, logs: Path) -> subprocess.Popen:
    env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank % per_node)}
    err = open(logs / f"rank{rank}.err", "w")
    out = subprocess.PIPE if rank == 0 else subprocess.DEVNULL
    return subprocess.Popen(args, env=env, stdout=out, stderr=err, text=True, cwd=os.getcwd(),
                            preexec_fn=_die_with_parent if sys.platform == "linux" else None)


def _die_with_parent() -> None:
    """In a rank, before it runs: the kernel kills it when the `piper calibrate` that started it dies (killed, or
    stopped by a signal its Python does not handle), rather than leaving it in gloo's rendezvous for 30 minutes."""
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1                                # linux/prctl.h
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _follow_progress(proc: subprocess.Popen, reporter: Reporter, counter: dict) -> None:
    """Rank 0's progress lines -> the reporter, until its stdout closes (run in a thread beside _wait_ranks)."""
    from piper_plan.calibration.bench_collectives import PROGRESS_PREFIX

    started = False
    for line in proc.stdout:
        if not line.startswith(PROGRESS_PREFIX):
            continue
        msg = json.loads(line[len(PROGRESS_PREFIX):])
        if "skipped" in msg:                      # the last line: points --resume kept
            counter["skipped"] = msg["skipped"]
            continue
        if not started:
            reporter.start("collectives", msg["total"])
            started = True
        reporter.advance("collectives", msg["label"], done=msg["done"])
        counter["measured"] += 1


def _tail(path: Path, lines: int = 3) -> str:
    text = path.read_text(errors="replace").strip().splitlines() if path.is_file() else []
    return " | ".join(text[-lines:]) or "(no output)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ metadata


def _merge_meta(out_dir: Path, data: dict) -> None:
    from piper_plan.calibration.io import write_metadata

    write_metadata(out_dir, data)


def _write_run_metadata(opts: SweepOptions, platform, result: SweepResult) -> None:
    versions = {"python": pyplatform.python_version()}
    for mod in ("torch", "numpy", "scipy", "pandas"):
        module = sys.modules.get(mod)
        if module is not None:
            versions[mod] = getattr(module, "__version__", "?")
    _merge_meta(opts.out_dir, {
        "platform": platform.name, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(), "command": opts.command, "versions": versions,
        "last_run": {"rows_written": result.rows_written, "skipped": result.skipped, "seconds": result.seconds,
                     "quick": opts.quick, "resume": opts.resume, "only": list(opts.only)},
    })


def _today() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d")
