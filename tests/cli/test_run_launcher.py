"""`piper run`'s launcher side: the run directory checked before any rank starts, stop signals forwarded to the
ranks (they checkpoint and exit 75, no traceback, no rank left behind), and torch elastic's own log lines kept
off a rank's one 'error:' line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from piper_plan.cli import run as run_module
from piper_plan.cli.main import cli
from piper_plan.errors import EXIT_REQUEUE, EXIT_USER_ERROR

PIPER = Path(sys.executable).parent / "piper"
CLEAN_ENV = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")}
ESTIMATE = ["estimate", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1", "--dp", "2", "--ep", "2",
            "--seq", "128", "--global-batch", "8"]


def two_rank_plan(tmp_path: Path, name: str = "plan.json", model: str = "tiny-moe", **runtime) -> Path:
    path = tmp_path / name
    args = [*ESTIMATE, "-o", str(path)]
    args[args.index("--model") + 1] = model
    done = CliRunner().invoke(cli, args)
    assert done.exit_code == 0, done.output
    if runtime:
        plan = json.loads(path.read_text())
        plan["runtime"].update(runtime)
        path.write_text(json.dumps(plan))
    return path


def run_here(plan: Path, out: str, *extra: str):
    return CliRunner().invoke(cli, ["run", "--plan", str(plan), "--steps", "1", "--out-dir", out, *extra],
                              env={"RANK": None, "WORLD_SIZE": None, "SLURM_PROCID": None, "SLURM_NTASKS": None})


def one_error_line(done) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.exit_code == EXIT_USER_ERROR and len(lines) == 1 and lines[0].startswith("error: "), done.output
    assert "Traceback" not in done.output
    return lines[0]


# ---- the run directory, before any rank starts (fast: no torch, no ranks) ------------------------------------
def test_an_out_dir_that_cannot_be_a_directory_is_one_line(tmp_path, monkeypatch):
    plan = two_rank_plan(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("hi\n")
    cases = {"afile/sub": "afile is a file, not a folder", "/proc/nope": "/proc/nope is a device or kernel file",
             "/dev/null": "is not a folder", "": "names no directory", " ": "names no directory"}
    for out, needle in cases.items():
        line = one_error_line(run_here(plan, out))
        assert "--out-dir" in line and needle in line, (out, line)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "plan.json"]    # nothing written here


def test_a_run_directory_that_holds_a_run_needs_resume_or_force(tmp_path, monkeypatch):
    """A second `piper run` into the same --out-dir replaced metrics.jsonl and the checkpoints without a word (launch
    refuses a non-empty --out-dir without --force): refused now; --resume continues a checkpoint, --force starts
    over, and --resume where no checkpoint is left (it would start from step 0) is refused too."""
    plan = two_rank_plan(tmp_path)
    run = tmp_path / "rx"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("5\n")
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "plan.json").write_text(plan.read_text())
    line = one_error_line(run_here(plan, str(run)))
    assert line == (f"error: {run}: holds a run (checkpoints to step 5 and metrics.jsonl); --resume continues it, "
                    "--force starts over and replaces them, or use another --out-dir"), line
    assert "give one of them" in one_error_line(run_here(plan, str(run), "--resume", "--force"))
    started = []
    monkeypatch.setattr(run_module, "launch_local", lambda layout, args, run_dir: started.append(args) or 0)
    for flag in ("--resume", "--force"):
        assert run_here(plan, str(run), flag).exit_code == 0
    assert [args[-1] for args in started] == ["--resume", "1"]       # --force is not a rank option: args end "--steps 1"
    # --force removed the old run's checkpoints before the new one started (before: a later --resume continued
    # the old run's weights under the new run's metrics)
    assert not (run / "checkpoints").exists() and (run / "metrics.jsonl").is_file()
    for extra in ((), ("--resume",)):
        line = one_error_line(run_here(plan, str(run), *extra))
        assert "holds a run's metrics.jsonl and no checkpoint to continue from" in line, line
    assert (run / "metrics.jsonl").read_text() == "{}\n"


@pytest.mark.parametrize("entry, needle", [("metrics.jsonl", "is a folder"), ("summary.json", "is a folder"),
                                           ("plan.json", "is a folder"), ("checkpoints", "is not a folder")])
def test_a_run_directory_entry_of_the_wrong_kind_is_one_line(tmp_path, entry, needle):
    plan = two_rank_plan(tmp_path)
    run = tmp_path / "rx"
    run.mkdir()
    if entry == "checkpoints":
        (run / entry).write_text("x\n")
    else:
        (run / entry).mkdir()
    line = one_error_line(run_here(plan, str(run)))
    assert line.startswith(f"error: {run / entry}: {needle}"), line


# ---- a stop signal's outcome (fast: the launcher's bookkeeping without ranks) --------------------------------
def test_a_stop_without_a_summary_of_this_run_is_128_plus_the_signal(tmp_path, capsys):
    (tmp_path / "summary.json").write_text('{"exit_code": 75}\n')           # an earlier run's
    before = run_module._identity(tmp_path / "summary.json")
    assert run_module._stopped(signal.SIGTERM, tmp_path, before) == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stopped by SIGTERM" in err[0]


def test_a_stop_the_ranks_checkpointed_is_their_exit_code(tmp_path, capsys):
    before = run_module._identity(tmp_path / "summary.json")                # none yet
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("7\n")
    (tmp_path / "summary.json").write_text('{"exit_code": 75}\n')
    assert run_module._stopped(signal.SIGUSR1, tmp_path, before) == EXIT_REQUEUE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stopped by SIGUSR1; checkpointed at step 7" in err[0] and "--resume" in err[0]


def test_the_launcher_forwards_sigusr1():
    assert "SIGUSR1" in run_module.STOP_SIGNALS.split(",")
    assert {"SIGTERM", "SIGINT"} <= set(run_module.STOP_SIGNALS.split(","))


def test_older_torch_without_the_signal_fields_still_forwards_sigusr1():
    """Older torch's LaunchConfig (2.6, piper's minimum) has neither signals_to_handle nor shutdown_timeout
    (passing them was a TypeError there): they are left out, and SIGUSR1 becomes the SignalException the agent
    forwards to the ranks."""
    import dataclasses

    from torch.distributed.elastic.multiprocessing import SignalException

    @dataclasses.dataclass
    class OldLaunchConfig:
        min_nodes: int = 1

    previous = signal.getsignal(signal.SIGUSR1)
    try:
        assert run_module.signal_options(OldLaunchConfig, 180) == {}
        with pytest.raises(SignalException) as stop:
            os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.value.sigval == signal.SIGUSR1
    finally:
        signal.signal(signal.SIGUSR1, previous)
    from torch.distributed.launcher.api import LaunchConfig

    if {"signals_to_handle", "shutdown_timeout"} <= {f.name for f in dataclasses.fields(LaunchConfig)}:
        assert run_module.signal_options(LaunchConfig, 180) == {"signals_to_handle": run_module.STOP_SIGNALS,
                                                                 "shutdown_timeout": 180}


def test_a_run_directory_another_piper_run_holds_is_refused_before_any_rank_starts(tmp_path):
    """Two `piper run`s in one directory wrote the same metrics.jsonl and checkpoints (before: both ran). While a
    launcher or its ranks hold the directory (rundir.hold_run_dir), another launcher is one line, exit 2."""
    from piper_plan.rundir import LOCK_FILE, hold_run_dir

    plan = two_rank_plan(tmp_path)
    (tmp_path / "run").mkdir()          # the live run has logged a step: said before "--force does so" (it was after)
    (tmp_path / "run" / "metrics.jsonl").write_text('{"schema_version": 1, "step": 1}\n')
    held = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                             "from piper_plan.rundir import hold_run_dir; hold_run_dir(Path(sys.argv[1]), False); "
                             "print('held', flush=True); time.sleep(60)", str(tmp_path / "run")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert held.stdout.readline().strip() == "held"           # a rank of another run holds it (shared)
        line = one_error_line(run_here(plan, str(tmp_path / "run")))
        assert "another `piper run` is writing this run directory" in line and str(tmp_path / "run") in line
    finally:
        held.kill()
        held.wait()
    fd = hold_run_dir(tmp_path / "run", launcher=True)             # free again: held by the first who asks
    os.close(fd)
    assert (tmp_path / "run" / LOCK_FILE).is_file()


def test_ranks_left_after_a_second_stop_signal_are_ended():
    """Ctrl-C twice ends torch's wait for the ranks; they went on saving after the launcher had said no checkpoint
    was made. The launcher's children that run piper's runtime are ended and reaped; other children are not."""
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", "piper_plan.runtime.train"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run_module._end_ranks_left()
        assert not Path(f"/proc/{rank.pid}").exists()           # killed and reaped (no zombie left)
        assert other.poll() is None
    finally:
        for proc in (rank, other):
            proc.kill()
            proc.wait()


def test_the_launcher_pid_is_set_for_its_ranks_only(monkeypatch, tmp_path):
    """PIPER_LAUNCHER_PID is for the ranks of this launch; left behind, a later rank started in-process (torchrun's
    path of `piper run`) would watch a parent it does not have and stop after its first step."""
    from types import SimpleNamespace

    from piper_plan.rundir import LAUNCHER_PID_ENV

    seen = []
    monkeypatch.delenv(LAUNCHER_PID_ENV, raising=False)
    monkeypatch.setattr(run_module, "_launch", lambda *a: seen.append(os.environ[LAUNCHER_PID_ENV]) or 0)
    layout = SimpleNamespace(world=2, emulated_topology=None)
    assert run_module.launch_local(layout, [], tmp_path) == 0
    assert seen == [str(os.getpid())] and LAUNCHER_PID_ENV not in os.environ


# ---- real runs: ranks started by the elastic launcher -------------------------------------------------------
def _ranks_of(run_dir: Path) -> list[int]:
    """Processes whose command line names this run's directory, from /proc: the launcher (--out-dir RUN_DIR) and its
    ranks (--out RUN_DIR)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(run_dir).encode() in cmdline:
            pids.append(int(proc.name))
    return pids


def _end(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.distributed
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_stop_signal_checkpoints_exits_75_and_leaves_no_rank(tmp_path, sig):
    """The signal a batch system (SIGUSR1, SIGTERM) or a user (Ctrl-C: SIGINT) sends `piper run`: the launcher
    forwards it, the ranks finish the step, checkpoint and exit 75; the launcher says so in one line and exits 75."""
    plan = two_rank_plan(tmp_path, steps=500, checkpoint_interval=1000)
    run_dir = tmp_path / "run"
    err_path = tmp_path / "stderr"
    with open(err_path, "w") as err:
        proc = subprocess.Popen([str(PIPER), "run", "--plan", str(plan), "--out-dir", str(run_dir)], cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=err, env=CLEAN_ENV, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-3000:]
            time.sleep(0.2)
        os.kill(proc.pid, sig)
        code = proc.wait(timeout=300)
        stderr = err_path.read_text()
        assert code == EXIT_REQUEUE, stderr[-3000:]
        assert "Traceback" not in stderr and "Exception" not in stderr, stderr[-3000:]
        assert (run_dir / "checkpoints" / "latest").is_file(), stderr[-3000:]
        step = int((run_dir / "checkpoints" / "latest").read_text())
        assert (run_dir / "checkpoints" / f"step_{step}").is_dir()
        assert json.loads((run_dir / "summary.json").read_text())["exit_code"] == EXIT_REQUEUE
        said = [line for line in stderr.splitlines() if line.startswith("piper run: stopped")]
        assert said == [f"piper run: stopped by {sig.name}; checkpointed at step {step} in {run_dir / 'checkpoints'}, "
                        "resume with --resume"], stderr[-3000:]
        time.sleep(0.5)
        assert _ranks_of(run_dir) == [], "ranks left running after the launcher exited"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _end(_ranks_of(run_dir))


def _catches(pid: int, sig: signal.Signals) -> bool:
    """The process has a handler for ``sig`` (its SigCgt mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


@pytest.mark.distributed
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=lambda s: s.name)
def test_a_stop_signal_before_any_rank_started_is_one_line(tmp_path, sig):
    """A job cancelled as it starts: the launcher, still importing torch, got the batch system's signal and ended
    without a word (its default action; SIGUSR1 alike). Now: one line and 128 + N, no rank started."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([str(PIPER), "run", "--plan", str(two_rank_plan(tmp_path)), "--out-dir", str(run_dir)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=CLEAN_ENV,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not _catches(proc.pid, sig):       # once piper's handler is in place: Python's own has none for it
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.005)
        os.kill(proc.pid, sig)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 128 + sig, stderr[-3000:]
        assert stderr.splitlines() == [f"piper run: stopped by {sig.name} before any rank started (nothing to "
                                       "checkpoint)"], stderr[-3000:]
        assert _ranks_of(run_dir) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_another_models_run_directory_is_refused_before_any_rank_starts(tmp_path):
    """Before: the ranks started, then each refused it (design notes said "before any rank starts")."""
    run = tmp_path / "rx"
    run.mkdir()
    (run / "plan.json").write_text(two_rank_plan(tmp_path, "plain.json", model="tiny-moe-plain").read_text())
    line = one_error_line(run_here(two_rank_plan(tmp_path), str(run)))
    assert line.startswith(f"error: {run / 'plan.json'}: model.name: ") and "another model" in line, line
    assert sorted(p.name for p in run.iterdir()) == ["plan.json"]


@pytest.mark.distributed
def test_a_rank_side_user_error_is_its_one_line(tmp_path):
    """A checkpoint of another model, resumed (the kept plan.json moved away, so only the ranks can tell): the
    rank's 'error:' line and none of torch elastic's own lines ('Sending process N closing signal SIGTERM',
    'failed (exitcode: 2) ...')."""
    run_dir = tmp_path / "r"
    first = subprocess.run([str(PIPER), "run", "--plan", str(two_rank_plan(tmp_path, checkpoint_interval=1)),
                            "--steps", "1", "--out-dir", str(run_dir)], cwd=tmp_path, capture_output=True, text=True,
                           env=CLEAN_ENV, timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    other = two_rank_plan(tmp_path, "plain.json", model="tiny-moe-plain")
    (run_dir / "plan.json").unlink()
    done = subprocess.run([str(PIPER), "run", "--plan", str(other), "--steps", "2", "--out-dir", str(run_dir),
                           "--resume"], cwd=tmp_path, capture_output=True, text=True, env=CLEAN_ENV, timeout=180)
    lines = [line for line in done.stderr.splitlines() if not line.startswith("piper run: 2 local ranks")]
    assert done.returncode == EXIT_USER_ERROR, done.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "another model" in lines[0], done.stderr[-3000:]
    assert _ranks_of(run_dir) == []


@pytest.mark.distributed
def test_a_run_leaves_nothing_in_the_temp_folder(tmp_path):
    """torch's elastic launcher made an empty $TMPDIR/torchelastic_*/piper-run-PID_*/attempt_0/{0,1} for every local
    run and never removed it (1,547 of them in /tmp)."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    done = subprocess.run([str(PIPER), "run", "--plan", str(two_rank_plan(tmp_path)), "--steps", "1", "--out-dir",
                           str(tmp_path / "r")], cwd=tmp_path, capture_output=True, text=True,
                          env={**CLEAN_ENV, "TMPDIR": str(temp)}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [p.name for p in temp.iterdir() if p.name.startswith("torchelastic_")] == [], list(temp.rglob("*"))


@pytest.mark.distributed
def test_a_short_run_resumes_where_it_ended_under_another_layout(tmp_path):
    """A run of 2 steps (checkpoint_interval 50) wrote no checkpoint: `--resume` with another layout trained from
    step 0 again, silently, and metrics.jsonl held step 1 twice. The last step is checkpointed now; a resume that
    finds no checkpoint says so."""
    run_dir = tmp_path / "r"
    first = subprocess.run([str(PIPER), "run", "--plan", str(two_rank_plan(tmp_path)), "--steps", "2", "--out-dir",
                            str(run_dir)], cwd=tmp_path, capture_output=True, text=True, env=CLEAN_ENV, timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (run_dir / "checkpoints" / "latest").exists()
    pipeline = tmp_path / "pp2.json"
    done = CliRunner().invoke(cli, [*ESTIMATE[:ESTIMATE.index("--dp")], "--pp", "2", "--seq", "128",
                                    "--global-batch", "8", "-o", str(pipeline)])
    assert done.exit_code == 0, done.output
    resumed = subprocess.run([str(PIPER), "run", "--plan", str(pipeline), "--steps", "3", "--out-dir", str(run_dir),
                              "--resume"], cwd=tmp_path, capture_output=True, text=True, env=CLEAN_ENV, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3] and "no checkpoint" not in resumed.stderr
    assert "step 3/3" in resumed.stderr and "step 1/3" not in resumed.stderr     # it trained step 3 only
    fresh = subprocess.run([str(PIPER), "run", "--plan", str(pipeline), "--steps", "1", "--out-dir",
                            str(tmp_path / "new"), "--resume"], cwd=tmp_path, capture_output=True, text=True,
                           env=CLEAN_ENV, timeout=180)
    assert fresh.returncode == 0 and "note: --resume: no checkpoint in" in fresh.stderr, fresh.stderr[-3000:]


def _start(plan: Path, run_dir: Path, err_path: Path) -> subprocess.Popen:
    """`piper run` in its own session, writing stderr to ``err_path``; returns once the first step is recorded."""
    with open(err_path, "w") as err:
        proc = subprocess.Popen([str(PIPER), "run", "--plan", str(plan), "--out-dir", str(run_dir)],
                                cwd=run_dir.parent, stdout=subprocess.DEVNULL, stderr=err, env=CLEAN_ENV,
                                start_new_session=True)
    deadline = time.monotonic() + 180
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-3000:]
        time.sleep(0.2)
    return proc


def _exited(pid: int) -> bool:
    """The process has released its files (its run-directory lock included): gone, or a zombie. Not its command
    line read empty: /proc shows that from the start of its exit, before the kernel closes its files (CI once saw
    a resume refused just after `_ranks_of` found no rank)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def _wait_gone(pids: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(_exited(pid) for pid in pids):
        assert time.monotonic() < deadline, "ranks still running"
        time.sleep(0.2)


@pytest.mark.distributed
def test_the_ranks_of_a_killed_launcher_checkpoint_and_stop(tmp_path):
    """The launcher killed outright (the OOM killer, `kill -9`): before, its ranks trained on unwatched to the last
    step, and a `--resume` meanwhile ran a second set into the same files. Now they see their parent gone, finish
    the step, checkpoint and exit 75; a resume then continues from that checkpoint."""
    plan = two_rank_plan(tmp_path, steps=5000, checkpoint_interval=5000)
    run_dir = tmp_path / "run"
    proc = _start(plan, run_dir, tmp_path / "stderr")
    ranks = _ranks_of(run_dir)
    try:
        assert len(ranks) == 3, ranks        # the launcher (its --out-dir) and its two ranks
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _wait_gone(ranks, 120)
        summary = json.loads((run_dir / "summary.json").read_text())
        step = int((run_dir / "checkpoints" / "latest").read_text())
        assert summary["exit_code"] == EXIT_REQUEUE and 0 < step == summary["steps"] < 5000
        resumed = run_here(plan, str(run_dir), "--resume")        # the directory is free again
        assert resumed.exit_code == 0, resumed.output
    finally:
        _end(_ranks_of(run_dir))


@pytest.mark.distributed
def test_a_rank_killed_or_stopped_alone_is_one_line_each(tmp_path):
    """One rank killed (SIGKILL): the others say in one line each that a peer is gone and the launcher names the
    rank and signal (before: a full traceback from every other rank). One rank crashed (SIGSEGV, as a fault in
    native code raises it): the same, after the rank's own Python stack (faulthandler; before: nothing of where it
    was). One rank sent SIGTERM: every rank checkpoints, and the launcher says so (before: exit 75 and nothing
    said)."""
    from piper_plan.runtime.train import EXIT_PEER_LOST

    plan = two_rank_plan(tmp_path, steps=5000, checkpoint_interval=5000)
    for sig, run_dir in ((signal.SIGKILL, tmp_path / "killed"), (signal.SIGSEGV, tmp_path / "crashed"),
                         (signal.SIGTERM, tmp_path / "stopped")):
        err_path = tmp_path / f"{sig.name}.stderr"
        proc = _start(plan, run_dir, err_path)
        ranks = _ranks_of(run_dir)
        try:
            target = max(pid for pid in ranks if pid != proc.pid)          # a rank, never the launcher
            rank = next(int(v[5:]) for v in Path(f"/proc/{target}/environ").read_bytes().decode().split("\0")
                        if v.startswith("RANK="))
            os.kill(target, sig)
            code = proc.wait(timeout=120)
            stderr = err_path.read_text()
            assert "Traceback" not in stderr, stderr[-3000:]
            said = [line for line in stderr.splitlines() if not line.startswith("step ")]
            if sig == signal.SIGSEGV:                  # the rank's stack, then the same lines as for SIGKILL
                stack = stderr.index("Fatal Python error: Segmentation fault")
                assert 'piper_plan/runtime/' in stderr[stack:], stderr[-3000:]
                assert code == 128 + signal.SIGSEGV, stderr[-3000:]
                assert said[-1].startswith("piper run: rank ") and said[-1].endswith(
                    "was killed by SIGSEGV (its Python stack is above, on its stderr)"), stderr[-3000:]
            elif sig == signal.SIGKILL:
                assert code == 128 + signal.SIGKILL, stderr[-3000:]
                assert said[-1].startswith("piper run: rank ") and said[-1].endswith("was killed by SIGKILL")
                assert all("a rank it exchanges with is gone" in line for line in said[1:-1]), stderr[-3000:]
                assert EXIT_PEER_LOST != 0
            else:
                step = int((run_dir / "checkpoints" / "latest").read_text())
                assert code == EXIT_REQUEUE, stderr[-3000:]
                assert said[-1] == (f"piper run: rank {rank} (pid {target}) was sent a stop signal; checkpointed at "
                                    f"step {step} in {run_dir / 'checkpoints'}, resume with --resume"), stderr[-3000:]
            _wait_gone(ranks, 30)
        finally:
            if proc.poll() is None:
                proc.kill()
            _end(_ranks_of(run_dir))


def test_the_cause_of_a_failed_run_is_the_rank_killed_from_outside():
    """Its peers' 'gone' lines (exit 1) may be seen in the same second: the killed rank is the cause. A rank torch
    killed after its shutdown wait, seconds after a rank's own error, is not."""
    from types import SimpleNamespace

    def failure(code, at):
        return SimpleNamespace(exitcode=code, timestamp=at, pid=100)

    class Failed:
        def __init__(self, failures):
            self.failures = failures

        def get_first_failure(self):
            rank = min(self.failures, key=lambda r: self.failures[r].timestamp)
            return rank, self.failures[rank]

    peer_gone = Failed({0: failure(1, 50), 1: failure(-signal.SIGKILL, 50), 2: failure(1, 51)})
    assert run_module._cause(peer_gone)[0] == 1
    own_error = Failed({0: failure(2, 50), 1: failure(-signal.SIGTERM, 50), 2: failure(-signal.SIGKILL, 80)})
    assert run_module._cause(own_error)[0] == 0


def _rank_children(pid: int, module: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", module], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out if _descends_from(int(p), pid)]


def _loading_torch(pid: int) -> bool:
    """Whether torch's libraries are mapped in ``pid`` (it is importing torch, or has)."""
    try:
        return "torch/lib" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
        if pid == ancestor:
            return True
    return False


@pytest.mark.distributed
@pytest.mark.parametrize("command, module", [
    (["run", "--plan", "{plan}", "--out-dir", "{tmp}/run", "--steps", "50"], "piper_plan.runtime.train"),
    (["bench", "a2a", "--nodes", "2", "--ranks-per-node", "2", "--no-save"], "multiprocessing"),
], ids=["run", "bench-a2a"])
def test_ctrl_c_while_the_ranks_start_prints_no_rank_traceback(tmp_path, command, module):
    """A terminal's Ctrl-C (SIGINT to the whole process group) as the ranks import torch: each rank printed its own
    KeyboardInterrupt traceback (bench a2a: 233-240 lines). Now the ranks end quietly, nothing is left running,
    and the command exits 130 with at most its own lines."""
    args = [a.replace("{plan}", str(two_rank_plan(tmp_path))).replace("{tmp}", str(tmp_path)) for a in command]
    proc = subprocess.Popen([str(PIPER), *args], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=CLEAN_ENV, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while sum(map(_loading_torch, _rank_children(proc.pid, module))) < 2:   # past the interpreter's start
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.01)
        ranks = _rank_children(proc.pid, module)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 130, stderr[-3000:]
        assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
        time.sleep(0.5)
        assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()
                    and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.distributed
def test_a_rank_killed_while_the_run_starts_is_one_line_too(tmp_path):
    """Rank 0 killed between the ranks' start and their first step (the agreements before it, a checkpoint's load):
    before, rank 1 printed a traceback out of first_failed_rank's all_reduce (5 of 5 tries at 3-4.5 s). Now the
    same lines as in a step, whenever the kill lands: rank 1's one 'error:' line (none where torch's agent ended it
    before it met rank 0 in a collective) and the launcher's."""
    plan = two_rank_plan(tmp_path, steps=5000, checkpoint_interval=5000)
    for delay_s in (1.0, 2.5, 4.0):
        run_dir = tmp_path / f"run{delay_s:g}"
        err_path = tmp_path / f"{delay_s:g}.stderr"
        with open(err_path, "w") as err:
            proc = subprocess.Popen([str(PIPER), "run", "--plan", str(plan), "--out-dir", str(run_dir)],
                                    cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err, env=CLEAN_ENV,
                                    start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while len(ranks := _ranks_of(run_dir)) < 3:             # the launcher and its two ranks
                assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-3000:]
                time.sleep(0.05)
            time.sleep(delay_s)
            rank0 = next(pid for pid in ranks if pid != proc.pid and b"RANK=0" in
                         Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
            os.kill(rank0, signal.SIGKILL)
            code = proc.wait(timeout=120)
            stderr = err_path.read_text()
            said = [line for line in stderr.splitlines() if not line.startswith(("step ", "piper run: 2 local"))]
            assert "Traceback" not in stderr and code == 128 + signal.SIGKILL, (delay_s, stderr[-3000:])
            assert said[-1] == f"piper run: rank 0 (pid {rank0}) was killed by SIGKILL", (delay_s, said)
            assert all(line.startswith("error: rank 1, ") and "a rank it exchanges with is gone" in line
                       for line in said[:-1]) and len(said) <= 2, (delay_s, said)     # none: ended before it met one
            _wait_gone(ranks, 30)
        finally:
            if proc.poll() is None:
                proc.kill()
            _end(_ranks_of(run_dir))
