"""``piper run --plan plan.json``: train a plan.

Under torchrun or srun this process is one rank (``python -m piper_plan.runtime.train`` with the same options).
Started by hand, it checks the plan first (no torch yet: a missing or bad file is one line at once), then starts
the plan's ranks itself with torch's elastic launcher when they fit this machine (one node; CPU ranks of several
emulated nodes), or prints the exact torchrun and srun lines for the allocation the plan needs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

import click

from piper_plan.cli.common import (AsciiInt, EXIT_CHECK_FAILED, console, exit_codes, json_option, note, out_dir_option,
                                   print_json)
from piper_plan.errors import EXIT_REQUEUE, EXIT_USER_ERROR, PiperError
from piper_plan.launchenv import signal_name
from piper_plan.planfile import MAX_STEPS

EPILOG = exit_codes({EXIT_CHECK_FAILED: "the loss went nan / inf (one 'error:' line naming the step, the lr, weight "
                                        "decay and aux-loss coeff; every rank stops), or a rank's peer is gone",
                     EXIT_REQUEUE: "checkpointed on SIGTERM / SIGUSR1 / SIGINT (the batch script requeues), also when "
                                   "the launcher itself is killed: its ranks then stop",
                     128: "+ N: a rank was killed by signal N (the launcher names it)"}) + (
    " A plan that needs more than this machine is not run: the torchrun and srun lines to run it are the result"
    " (exit 0).")


@click.command("run", epilog=EPILOG)
@click.option("--plan", "plan", required=True, type=click.Path(), help="plan.json to run.")
@click.option("--steps", type=AsciiInt(min=1, max=MAX_STEPS), default=None,
              help="Optimizer steps (default: the plan's runtime.steps).")
@out_dir_option("out", "Run directory (metrics.jsonl, summary.json, checkpoints/).", old=("--out",), default="run",
                show_default=True)
@click.option("--resume", is_flag=True, help="Continue from RUN_DIR/checkpoints/latest.")
@click.option("--force", is_flag=True, help="Start over in a run directory that holds a run (its metrics and "
              "checkpoints are replaced); without it, or --resume, such a directory is refused.")
@click.option("--profile", type=AsciiInt(min=0), default=0, metavar="STEPS",
              help="Chrome trace of STEPS steps after the first.")
@click.option("--lr", type=float, default=None,
              help="Peak learning rate, above 0 and at most 1e4 (default: the plan's runtime.lr).")
@click.option("--aux-loss-coeff", type=float, default=None,
              help="Balance-loss coefficient, 0 (off) to 1e4 (default: the plan's runtime.aux_loss_coeff).")
@json_option(help="The run's summary (summary.json with the run directory), or the commands for a plan that does "
                  "not fit here, as JSON on stdout.")
def run_cmd(plan, steps, out, resume, force, profile, lr, aux_loss_coeff, as_json) -> None:
    """Train a plan.json: on this machine's own ranks when they fit, else print the torchrun / srun lines."""
    from piper_plan.launch.local import runtime_args
    from piper_plan.launchenv import read_launch_env

    _check_file(plan)
    if resume and force:
        raise PiperError("--resume continues the run in --out-dir and --force starts it over: give one of them")
    args = runtime_args(plan, out, steps, resume, profile, lr, aux_loss_coeff)
    env = read_launch_env()
    if env.launched:                     # one rank of a job torchrun or srun started
        from piper_plan.runtime.train import main

        code = main(args)
        if as_json and env.rank == 0:
            print_run_summary(Path(out), code)
        sys.exit(code)
    with _stop_before_ranks_said():
        code = _run_here_or_print(plan, steps, out, resume, force, profile, lr, aux_loss_coeff, as_json, args)
    if code is None:                     # the torchrun and srun lines were the result
        return
    if as_json:
        print_run_summary(Path(out), code)
    sys.exit(code)


def _run_here_or_print(plan, steps, out, resume, force, profile, lr, aux_loss_coeff, as_json, args) -> int | None:
    """The plan run by this machine's own ranks (their exit code), or, when they do not fit here, the torchrun and
    srun lines that run it printed (None)."""
    from piper_plan.launch.local import runtime_args

    cfg, layout = _checked_plan(args, Path(plan))
    if not layout.runs_here:
        absolute = runtime_args(str(Path(plan).resolve()), str(Path(out).resolve()), steps, resume, profile, lr,
                                aux_loss_coeff)            # the nodes need not share this working directory
        _print_commands(layout, absolute, as_json)
        return None
    _check_run_dir(out, plan, resume, force)
    _check_devices(cfg, layout)
    from piper_plan.rundir import clear_run, hold_run_dir

    held = hold_run_dir(Path(out), launcher=True)      # its ranks share the hold; they keep it until they end
    if force:
        clear_run(Path(out))
    note(f"piper run: {layout.world} local ranks" + (f" ({layout.emulated_topology} emulated nodes)"
                                                     if layout.emulated_topology else "") + f", run directory {out}")
    try:
        return launch_local(layout, args, Path(out))
    finally:
        os.close(held)


class _StoppedBeforeRanks(BaseException):
    """A stop signal before any rank started. A BaseException, as KeyboardInterrupt is: no `except Exception` on
    its way out (torch's rendezvous, an import under way) turns it into another error."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum, frame):
    raise _StoppedBeforeRanks(signum)


@contextlib.contextmanager
def _stop_before_ranks_said():
    """A stop signal (STOP_SIGNALS but SIGINT, which is Ctrl-C's exit 130) before torch's launcher takes the
    signals over, which it does just before it starts the ranks: one line and 128 + N. Before, the default action
    ended the launcher without a word while it imported torch (a second or more). The handlers in place before
    are restored on the way out."""
    before = {}
    try:
        for name in STOP_SIGNALS.split(","):
            if name != "SIGINT":        # one may come as the next is put in place: inside the try
                before[getattr(signal, name)] = signal.signal(getattr(signal, name), _raise_stopped)
        yield
    except _StoppedBeforeRanks as exc:
        note(f"piper run: stopped by {signal_name(exc.signum)} before any rank started (nothing to checkpoint)")
        sys.exit(128 + exc.signum)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _check_file(plan: str) -> None:
    """A missing plan is one line before anything heavy is imported."""
    path = Path(plan)
    if not path.exists():
        raise PiperError("no such file", path=plan)
    if not path.is_file():
        raise PiperError("is not a file", path=plan)


def _checked_plan(args: list[str], plan: Path):
    """(the plan with the options applied, its layout) after every check the ranks would make before any
    collective (runtime/train.py preflight) but the GPU one, and `piper launch`'s (launch/job.py
    checked_as_priced_now: a plan that does not fit as the runtime runs it, priced again from the file, is refused
    here too, not handed out as torchrun / srun lines): here, and without torch."""
    from pydantic import ValidationError

    from piper_plan.catalog import validation_message
    from piper_plan.launch.job import checked_as_priced_now
    from piper_plan.launch.local import layout_of
    from piper_plan.runtime.train import load_plan, parse_args, preflight

    try:
        cfg = load_plan(parse_args(args))
    except ValidationError as exc:      # an option out of range (--lr nan): with_runtime validates the block
        raise PiperError(validation_message(exc), field="runtime options") from None
    checked_as_priced_now(cfg, plan)        # `piper launch`'s check and line, on the plan priced again from the file
    preflight(cfg, cfg.parallel.world, cuda_available=True)
    return cfg, layout_of(cfg)


def _check_devices(cfg, layout) -> None:
    """A GPU plan on a machine without one, or with fewer than its ranks (the local launcher shows every rank all
    of them), is one line here, not the same line from every rank."""
    if cfg.platform.launch.device == "cuda":
        import torch

        from piper_plan.launchenv import check_visible_devices
        from piper_plan.runtime.train import preflight

        preflight(cfg, cfg.parallel.world, torch.cuda.is_available())
        check_visible_devices(torch.cuda.device_count(), layout.ranks_per_node, "torchrun")


STOP_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
"""Signals the launcher forwards to the ranks (torch's default set plus SIGUSR1, the batch script's checkpoint
signal); without SIGUSR1 here its default action killed the launcher and orphaned the ranks."""
QUIET_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher")


def launch_local(layout, args: list[str], run_dir: Path) -> int:
    """The plan's ranks as local processes (torch.distributed's elastic launcher, as torchrun --standalone);
    the first failed rank's exit code, else 0. A stop signal (STOP_SIGNALS) is forwarded to the ranks, which
    checkpoint and exit 75; the result is then the ranks' own (summary.json of this run), else 128 + the signal."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    from piper_plan.launch.render import SIGNAL_LEAD_S

    from piper_plan.rundir import LAUNCHER_PID_ENV

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    launcher_before = os.environ.get(LAUNCHER_PID_ENV)  # restored below: for this launch's ranks only
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())     # the ranks stop (checkpointed) if this process is gone
    if layout.emulated_topology:
        os.environ["PIPER_EMULATE_TOPOLOGY"] = layout.emulated_topology
    # shutdown_timeout: how long the agent waits, after forwarding a stop signal, for the ranks to finish the step
    # they are in, write a checkpoint and exit 75, before it SIGKILLs them (torch's default, 30 s, would kill a rank
    # of a large model in the middle of its save). The batch script asks Slurm for USR1 this long before the time
    # limit (launch/render.py SIGNAL_LEAD_S, 180 s): a step plus a checkpoint must fit that bound there too. A rank
    # that hangs is still ended after it: bounded, never orphaned.
    sigusr1 = signal.getsignal(signal.SIGUSR1)      # signal_options may replace it (older torch): restored below
    # logs_specs: no log folder. torch's default made $TMPDIR/torchelastic_*/<run_id>/attempt_0/<rank>/ for each run
    # and never removed it; the ranks write to this terminal (no redirects) and no rank writes an error.json there.
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=layout.world, run_id=f"piper-run-{os.getpid()}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                          logs_specs=DefaultLogsSpecs(log_dir=os.devnull), **signal_options(LaunchConfig, SIGNAL_LEAD_S))
    _quiet_elastic_logs()
    before = _identity(run_dir / "summary.json")
    try:
        return _launch(config, args, run_dir, before)
    finally:
        signal.signal(signal.SIGUSR1, sigusr1)
        if launcher_before is None:
            os.environ.pop(LAUNCHER_PID_ENV, None)
        else:
            os.environ[LAUNCHER_PID_ENV] = launcher_before


def _launch(config, args: list[str], run_dir: Path, before) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    try:
        elastic_launch(config, sys.executable)("-m", "piper_plan.runtime.train", *args)
    except ChildFailedError as exc:
        rank, failure = _cause(exc)
        if failure.exitcode < 0:         # killed by a signal: the rank could say nothing itself but its stack
            from piper_plan.runtime.train import CRASH_SIGNALS

            name = signal_name(-failure.exitcode)
            stack = " (its Python stack is above, on its stderr)" if name in CRASH_SIGNALS else ""
            note(f"piper run: rank {rank} (pid {failure.pid}) was killed by {name}{stack}")
            return 128 - failure.exitcode
        if failure.exitcode == EXIT_REQUEUE:   # a stop signal sent to a rank, not to this launcher
            step = _latest_checkpoint(run_dir)
            at = f" at step {step}" if step is not None else ""
            summary = run_dir / "summary.json"      # this run's (not one left by an earlier run): its signalled ranks
            fresh = _identity(summary) not in (None, before)
            listed = _summary_field(summary, "stop_ranks") if fresh else None
            sent = [r for r in listed if type(r) is int and r in exc.failures] if isinstance(listed, list) else []
            whom = ", ".join(f"rank {r} (pid {exc.failures[r].pid})" for r in sent or [rank])   # every rank exits 75
            note(f"piper run: {whom} {'was' if len(sent) < 2 else 'were'} sent a stop signal; checkpointed{at} in "
                 f"{run_dir / 'checkpoints'}, resume with --resume")
        return failure.exitcode          # the rank said why on its stderr (an 'error:' line or its traceback)
    except SignalException as exc:
        _end_ranks_left()
        return _stopped(int(exc.sigval), run_dir, before)
    return 0


def _cause(exc) -> tuple:
    """(rank, failure) that ended the run: torch's first failure (its timestamps are whole seconds, ties go to the
    lowest rank), unless a rank was killed from outside within a second of it: then that one, not a peer that lost
    it (an 'error:' line, exit 1). A rank torch itself ended (SIGTERM at once, SIGKILL after its shutdown wait,
    seconds later) is never the cause."""
    first_rank, first = exc.get_first_failure()
    killed = sorted((r, f) for r, f in exc.failures.items()
                    if f.exitcode < 0 and f.exitcode != -signal.SIGTERM and f.timestamp - first.timestamp <= 1)
    return killed[0] if killed else (first_rank, first)


def _end_ranks_left() -> None:
    """SIGKILL and reap the ranks still alive once the launcher's own stop is over: after one stop signal torch's
    agent waits for them (they checkpoint and exit), but a second one (Ctrl-C twice: 'stop at once') ends its
    wait, and they went on saving after the launcher had said no checkpoint was made (Linux /proc: children
    whose command line runs piper's runtime)."""
    me = os.getpid()
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me and b"piper_plan.runtime.train" in cmdline:
            with contextlib.suppress(ProcessLookupError, ChildProcessError):    # it ended meanwhile
                os.kill(int(proc.name), signal.SIGKILL)
                os.waitpid(int(proc.name), 0)


def signal_options(launch_config_class, shutdown_timeout_s: int) -> dict:
    """LaunchConfig's signal fields where the installed torch has them: ``signals_to_handle`` came with pytorch PR
    160690 (merged 2025-08), ``shutdown_timeout`` with PR 172596 (merged 2026-03); piper allows torch >= 2.6,
    which has neither. Without ``signals_to_handle`` the launcher turns SIGUSR1 into torch's SignalException
    itself (installed here; launch_local restores the handler), which the agent forwards to the ranks like
    SIGTERM; without ``shutdown_timeout`` the ranks get torch's fixed 30 s to checkpoint before SIGKILL."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(launch_config_class)}
    if "signals_to_handle" not in names:
        _forward_sigusr1()
    wanted = {"signals_to_handle": STOP_SIGNALS, "shutdown_timeout": shutdown_timeout_s}
    return {name: value for name, value in wanted.items() if name in names}


def _forward_sigusr1() -> None:
    from torch.distributed.elastic.multiprocessing import SignalException

    def stop(signum, frame):
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    signal.signal(signal.SIGUSR1, stop)


def _quiet_elastic_logs() -> None:
    """torch elastic's own log lines ("Sending process N closing signal SIGTERM", "failed (exitcode: 2) ...") off:
    a rank's 'error:' line stays the only line. A crashing rank's traceback is its own stderr, shown as before;
    a rank killed by a signal is one line of launch_local's."""
    import logging

    for name in [*QUIET_LOGGERS, *logging.root.manager.loggerDict]:
        if name.startswith(QUIET_LOGGERS):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _identity(path: Path) -> tuple[int, int] | None:
    """(inode, mtime) of a file, None if missing: summary.json is written by an atomic rename (a new inode), so
    another identity after the launch means this run wrote it."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _stopped(signum: int, run_dir: Path, before: tuple[int, int] | None) -> int:
    """The outcome of a run stopped by a signal, as one line: the ranks' exit code from this run's summary.json
    (75: checkpointed), else 128 + the signal."""
    name = signal_name(signum)
    summary = run_dir / "summary.json"
    code = None
    if _identity(summary) not in (None, before):
        code = _summary_exit_code(summary)
    if code is None:
        note(f"piper run: stopped by {name} before the ranks wrote a summary (no checkpoint of this stop)")
        return 128 + signum
    if code == EXIT_REQUEUE:
        step = _latest_checkpoint(run_dir)
        at = f" at step {step}" if step is not None else ""
        note(f"piper run: stopped by {name}; checkpointed{at} in {run_dir / 'checkpoints'}, resume with --resume")
    else:
        note(f"piper run: stopped by {name}; the ranks ended with exit code {code}")
    return code


def _summary_exit_code(summary: Path) -> int | None:
    code = _summary_field(summary, "exit_code")
    return code if isinstance(code, int) and not isinstance(code, bool) and 0 <= code <= 255 else None


def _summary_field(summary: Path, name: str):
    """A field of the ranks' summary.json, or None (absent, unreadable)."""
    from piper_plan.fileio import parse_json, read_text

    try:
        return parse_json(read_text(summary), str(summary)).get(name)
    except (PiperError, AttributeError, OSError):
        return None


def _latest_checkpoint(run_dir: Path) -> int | None:
    from piper_plan.rundir import latest_step

    try:
        return latest_step(run_dir)
    except (PiperError, OSError):
        return None


def _check_run_dir(out: str, plan: str, resume: bool, force: bool) -> None:
    """The run directory, before any rank starts (the ranks check it again: rundir.py): a path that cannot be a
    directory, an entry of the wrong kind, another model's or training's run, or (without --force) a run it would
    replace is one line, exit 2."""
    from piper_plan.rundir import check_not_held, check_replaces_no_run, check_run_dir, plan_change

    check_run_dir(Path(out))
    check_not_held(Path(out))
    plan_change(Path(plan), Path(out))      # its note, where the layout changed, is the ranks' to print
    if not force:
        check_replaces_no_run(Path(out), resume)


def _print_commands(layout, args: list[str], as_json: bool) -> None:
    from piper_plan.launch.local import srun_command, torchrun_command

    torchrun = str(Path(sys.executable).parent / "torchrun")
    commands = {"torchrun": torchrun_command(layout, args, torchrun), "srun": srun_command(layout, args, sys.executable)}
    kind = "GPU" if layout.device == "cuda" else layout.device.upper()      # torch's "cuda" is ROCm's GPUs too
    why = (f"the plan needs {layout.nodes} nodes x {layout.ranks_per_node} {kind} ranks = {layout.world}; "
           "this machine runs one node (or CPU ranks standing in for nodes)")
    if as_json:
        print_json({"launched": False, "reason": why, "nodes": layout.nodes, "ranks_per_node": layout.ranks_per_node,
                    "world": layout.world, **commands})
        return
    note(f"piper run: not started here: {why}")
    out = console()
    out.print("# on every node (MASTER_ADDR = the first node's host name):", markup=False)
    out.print(commands["torchrun"], markup=False)
    out.print("# or once inside a Slurm allocation (salloc / sbatch; `piper launch` writes the whole job):", markup=False)
    out.print(commands["srun"], markup=False)


def print_run_summary(run_dir: Path, code: int) -> None:
    """summary.json of a finished run as one JSON object on stdout (nothing to print after a user error)."""
    from piper_plan.fileio import parse_json, read_text

    summary = run_dir / "summary.json"
    if code == EXIT_USER_ERROR or not summary.is_file():
        return
    print_json({"run_dir": str(run_dir), **parse_json(read_text(summary), str(summary))})
