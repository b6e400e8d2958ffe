"""Hostile conditions at the runtime's edges (runtime/train.py, runtime/checkpoint.py): Ctrl-C checkpoints and exits
75 (a second one stops at once), a damaged checkpoints/latest or piper.json, a run directory whose files are of the
wrong type, another plan's run directory, and a rank that never joins the rendezvous. Each is one `error:` line and
exit 2 on every rank, before training."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from piper_plan.catalog import load_model
from piper_plan.errors import PiperError
from piper_plan.runtime import train
from piper_plan import rundir
from piper_plan.rundir import first_difference
from piper_plan.rundir import latest_step
from piper_plan.runtime.checkpoint import _read_meta
from plans import plan_dict

ROOT = Path(__file__).resolve().parents[2]


# ---- checkpoints/latest and piper.json ------------------------------------------------------------------
@pytest.mark.parametrize("content,needle", [
    (b"\xff\xfe", "not a UTF-8 text file"),
    ("\u00b2".encode(), "found '\u00b2'"),       # str.isdigit() is True, int() refuses it
    (b"-1\n", "found '-1'"),
    (b"", "found ''"),
    (b"abc", "found 'abc'"),
    (None, "is a directory"),
])
def test_a_damaged_latest_is_one_line_naming_what_is_allowed(tmp_path, content, needle):
    latest = tmp_path / "checkpoints" / "latest"
    latest.parent.mkdir()
    latest.mkdir() if content is None else latest.write_bytes(content)
    with pytest.raises(PiperError) as exc:
        latest_step(tmp_path)
    message = str(exc.value)
    assert needle in message and str(latest) in message and "allowed: a decimal step number" in message
    assert "\n" not in message


def test_latest_absent_is_no_checkpoint_and_a_dangling_link_is_an_error(tmp_path):
    assert latest_step(tmp_path) is None
    (tmp_path / "checkpoints").mkdir()
    assert latest_step(tmp_path) is None
    (tmp_path / "checkpoints" / "latest").write_text("12\n")
    assert latest_step(tmp_path) == 12
    (tmp_path / "checkpoints" / "latest").unlink()
    (tmp_path / "checkpoints" / "latest").symlink_to(tmp_path / "nowhere")
    with pytest.raises(PiperError, match="a symbolic link to nothing"):
        latest_step(tmp_path)


@pytest.mark.parametrize("meta,needle", [
    ({}, "piper.json has no 'model'"),
    ({"model": {}, "parallel": {"ep": 1}, "world": "2", "step": 1, "slot_of_expert": {}}, "a str as its 'world'"),
    ({"model": {}, "parallel": {}, "world": 2, "step": 1, "slot_of_expert": {}}, "no 'parallel.ep'"),
])
def test_a_piper_json_without_its_fields_is_one_short_line(tmp_path, meta, needle):
    (tmp_path / "piper.json").write_text(json.dumps(meta))
    (tmp_path / ".metadata").write_bytes(b"")
    model = load_model("tiny-moe")
    _, problem = _read_meta(tmp_path, SimpleNamespace(cfg=SimpleNamespace(model=model)))
    assert needle in problem and len(problem) < 300, problem


def test_first_difference_shortens_long_values():
    found = first_difference(None, {f"k{i}": i for i in range(40)}, "model")
    assert found == "model: None (checkpoint) vs {... 40 fields} (plan)"
    assert first_difference({"a": 1}, {"a": 2}, labels=("run directory", "plan")) == "a: 1 (run directory) vs 2 (plan)"


# ---- the run directory ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,folder", [("metrics.jsonl", True), ("summary.json", True), ("plan.json", True),
                                         ("checkpoints/latest", True), ("checkpoints", False), (".", False)])
def test_a_run_directory_entry_of_the_wrong_type_is_one_line(tmp_path, name, folder):
    run = tmp_path / "run"
    path = run / name if name != "." else run
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir() if folder else path.write_text("x")
    with pytest.raises(PiperError) as exc:
        rundir.check_run_dir(run)
    assert str(exc.value).startswith(str(path) + ": ") and "allowed:" in str(exc.value), str(exc.value)


def test_a_fresh_or_finished_run_directory_passes(tmp_path):
    rundir.check_run_dir(tmp_path / "new")
    run = tmp_path / "run"
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    for name in rundir.RUN_FILES:
        (run / name).write_text("{}")
    rundir.check_run_dir(run)


def test_damaged_metrics_on_resume_is_one_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    assert [r["step"] for r in rundir.kept_records(path, 2)] == [1, 2]
    path.write_text('{"step": 1}\nnot json\n')
    with pytest.raises(PiperError, match="line 2: malformed JSON"):
        rundir.kept_records(path, 2)
    path.write_text('{"loss": 1}\n')
    with pytest.raises(PiperError, match="line 1: no integer 'step'"):
        rundir.kept_records(path, 2)
    # a last record cut short by a kill (no newline): a step past the checkpoint, dropped (before: resume refused)
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    assert [r["step"] for r in rundir.kept_records(path, 2)] == [1, 2]
    path.write_text('{"step": 1}\n{"step": 2, "lo\n')          # with its newline: not torn, damaged
    with pytest.raises(PiperError, match="line 2: malformed JSON"):
        rundir.kept_records(path, 2)


# ---- another plan in the run directory --------------------------------------------------------------------
def _write(path: Path, plan: dict) -> Path:
    path.write_text(json.dumps(plan))
    return path


def test_the_same_plan_or_none_kept_is_fine(tmp_path):
    plan = _write(tmp_path / "p.json", plan_dict(pp=2, dp=1, ep=1))
    run = tmp_path / "run"
    assert rundir.plan_change(plan, run) is None
    run.mkdir()
    rundir.keep_plan(plan, run)
    assert rundir.plan_change(plan, run) is None
    assert (run / "plan.json").read_text() == plan.read_text()


def test_another_layout_replaces_the_kept_plan_with_a_note(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rundir.keep_plan(_write(tmp_path / "a.json", plan_dict(pp=2, dp=1, ep=1)), run)
    other = _write(tmp_path / "b.json", plan_dict(pp=1, dp=2, ep=2, num_microbatches=1))  # the same tokens a step
    note = rundir.plan_change(other, run)
    assert note.startswith(f"{run / 'plan.json'} replaced by {other}") and "parallel." in note, note
    rundir.keep_plan(other, run)
    assert json.loads((run / "plan.json").read_text())["parallel"]["pp"] == 1


@pytest.mark.parametrize("change,needle", [
    ({"model": "tiny-dense", "ep": 1}, "model.name: 'tiny-moe' (run directory) vs 'tiny-dense' (plan)"),
    ({"seq_len": 32}, "training.seq_len: 16 (run directory) vs 32 (plan)"),
])
def test_another_model_or_training_is_refused(tmp_path, change, needle):
    run = tmp_path / "run"
    run.mkdir()
    rundir.keep_plan(_write(tmp_path / "a.json", plan_dict(pp=2, dp=1, ep=1)), run)
    kept = (run / "plan.json").read_bytes()
    other = _write(tmp_path / "b.json", plan_dict(**{"pp": 2, "dp": 1, "ep": 1, **change}))
    with pytest.raises(PiperError) as exc:
        rundir.plan_change(other, run)
    message = str(exc.value)
    assert needle in message and "holds another plan's run" in message and "use another --out-dir" in message
    assert (run / "plan.json").read_bytes() == kept


def test_a_training_field_only_the_planner_reads_is_the_same_run(tmp_path):
    """tokens_to_train and routing_skew price a plan, the runtime never reads them: before, editing one in plan.json
    refused the resume as another plan's run."""
    run = tmp_path / "run"
    run.mkdir()
    rundir.keep_plan(_write(tmp_path / "a.json", plan_dict(pp=2, dp=1, ep=1)), run)
    other = plan_dict(pp=2, dp=1, ep=1)
    other["training"].update(tokens_to_train=2e12, routing_skew=1.5)
    note = rundir.plan_change(_write(tmp_path / "b.json", other), run)
    assert note is not None and "first difference: training." in note       # replaced, with a note


def test_a_damaged_kept_plan_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").write_text("{not json")
    with pytest.raises(PiperError, match="malformed JSON.*move it aside"):
        rundir.plan_change(_write(tmp_path / "a.json", plan_dict(pp=2, dp=1, ep=1)), run)


# ---- signals, rendezvous timeout --------------------------------------------------------------------------
def test_sigint_sets_the_flag_once_then_the_default_is_back():
    before = signal.getsignal(signal.SIGINT)
    stop = train._StopFlag()
    try:
        os.kill(os.getpid(), signal.SIGINT)     # no KeyboardInterrupt: the flag
        time.sleep(0.05)
        assert stop.signum == signal.SIGINT
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL   # a second Ctrl-C would end the process
    finally:
        stop.release()
    assert signal.getsignal(signal.SIGINT) == before
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_an_ignored_sigint_stays_ignored():
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        stop = train._StopFlag()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        stop.release()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_rendezvous_timeout_setting():
    assert train.rendezvous_timeout_s({}) == train.RENDEZVOUS_TIMEOUT_S
    assert train.rendezvous_timeout_s({train.RENDEZVOUS_TIMEOUT_ENV: "12.5"}) == 12.5
    for bad in ("0", "-3", "nan", "inf", "soon", "1e9"):
        with pytest.raises(PiperError, match="allowed: seconds"):
            train.rendezvous_timeout_s({train.RENDEZVOUS_TIMEOUT_ENV: bad})


# ---- whole ranks -------------------------------------------------------------------------------------------
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(world: int, plan: dict, tmp: Path, *extra: str, ranks=None, env=None,
           file_limit_bytes: int | None = None) -> list[subprocess.Popen]:
    """Rank processes as srun starts them (SLURM_PROCID / SLURM_NTASKS), without a launcher; ``file_limit_bytes``:
    no file they write grows past it (RLIMIT_FSIZE: the write fails with EFBIG, as on a full disk)."""
    path = tmp / "plan.json"
    path.write_text(json.dumps(plan))
    port = str(_port())
    procs = []
    for rank in ranks if ranks is not None else range(world):
        rank_env = {**os.environ, "OMP_NUM_THREADS": "1", "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world),
                    "SLURM_LOCALID": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **(env or {})}
        cmd = [sys.executable, "-m", "piper_plan.runtime.train", "--plan", str(path), "--out", str(tmp / "run"), *extra]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, preexec_fn=None if file_limit_bytes is None else
                                      lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit_bytes,) * 2)))
    return procs


def _finish(procs, timeout=120) -> tuple[list[int], str]:
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes, "".join(p.stderr.read() for p in procs)


@pytest.mark.distributed
def test_ctrl_c_checkpoints_and_exits_75_on_every_rank(tmp_path):
    procs = _ranks(2, plan_dict(pp=2, dp=1, ep=1, num_microbatches=2, steps=400), tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert all(p.poll() is None for p in procs)
        time.sleep(0.2)
    for p in procs:                        # Ctrl-C reaches every process of the terminal's foreground group
        p.send_signal(signal.SIGINT)
    codes, err = _finish(procs)
    assert codes == [75, 75] and "Traceback" not in err, err[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    latest = int((tmp_path / "run" / "checkpoints" / "latest").read_text())
    assert summary["exit_code"] == 75 and 2 <= latest == summary["steps"] < 400


@pytest.mark.distributed
@pytest.mark.parametrize("damage", ["bytes", "superscript", "metrics_folder"])
def test_damaged_run_directory_every_rank_exits_2_with_one_line(tmp_path, damage):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    if damage == "metrics_folder":
        (run / "metrics.jsonl").mkdir()
        needle = "metrics.jsonl: is a folder"
    else:
        (run / "checkpoints" / "latest").write_bytes(b"\xff\xfe" if damage == "bytes" else "\u00b2".encode())
        needle = "checkpoints/latest: "
    codes, err = _finish(_ranks(2, plan_dict(pp=2, dp=1, ep=1, steps=2), tmp_path, "--resume"))
    assert codes == [2, 2], err[-3000:]
    assert err.count("error: ") == 1 and needle in err and "Traceback" not in err, err[-3000:]
    assert not (run / "summary.json").exists()


@pytest.mark.distributed
def test_a_checkpoint_with_damaged_values_is_one_line_not_a_diverged_run(tmp_path):
    """Bytes overwritten inside a shard file (not truncated: DCP reads it whole) loaded silently, and the run
    failed one step later as 'the loss is nan ... lower --lr'. Now every rank refuses the checkpoint in one line."""
    plan = plan_dict(pp=1, dp=2, ep=2, steps=2)
    codes, err = _finish(_ranks(2, plan, tmp_path))
    assert codes == [0, 0], err[-3000:]
    shard = max((tmp_path / "run" / "checkpoints" / "step_2").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4096] = b"\xff" * 4096          # float32 0xffffffff: nan
    shard.write_bytes(bytes(data))
    plan["runtime"]["steps"] = 3
    codes, err = _finish(_ranks(2, plan, tmp_path, "--resume"))
    assert codes == [2, 2], err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "step_2: " in lines[0] and "so the files are damaged" in lines[0], err[-3000:]
    assert "Traceback" not in err and "the loss is nan" not in err


@pytest.mark.distributed
def test_a_checkpoint_that_cannot_be_written_is_one_line_on_every_rank(tmp_path):
    """A file where the save's temporary folder goes (as a full disk or a permission would fail it): before, rank
    0's traceback and the other ranks' lost-connection tracebacks, exit 1. Now one line, exit 2, the steps before
    it kept in metrics.jsonl and summary.json."""
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step_2.tmp").write_text("in the way")
    codes, err = _finish(_ranks(2, plan_dict(pp=1, dp=2, ep=2, steps=2), tmp_path))
    assert codes == [2, 2], err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "cannot write the checkpoint of step 2: File exists" in lines[0], err[-3000:]
    assert "Traceback" not in err
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["exit_code"] == 2


@pytest.mark.distributed
@pytest.mark.parametrize("limit_bytes,steps_kept", [(3000, None), (20_000, 3)])
def test_records_that_cannot_be_written_are_one_line_on_every_rank(tmp_path, limit_bytes, steps_kept):
    """Rank 0's metrics.jsonl (or summary.json) growing past what the disk takes: before, rank 0's OSError traceback,
    the others' lost-connection tracebacks, exit 1. Now one line naming the file, exit 2 on every rank: at start
    (3,000 bytes: plan.json's copy does not fit) or at the step whose record does not fit, the steps before it kept."""
    plan = plan_dict(pp=1, dp=2, ep=2, steps=40)
    codes, err = _finish(_ranks(2, plan, tmp_path, file_limit_bytes=limit_bytes))
    assert codes == [2, 2], err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "cannot write" in lines[0], err[-3000:]
    assert "Traceback" not in err and "gone" not in err
    metrics = tmp_path / "run" / "metrics.jsonl"
    if steps_kept is None:
        assert "plan.json" in lines[0]
    else:
        assert "metrics.jsonl: cannot write: File too large" in lines[0], err[-3000:]
        kept = [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")]
        assert len(kept) >= steps_kept and kept[-1]["step"] < 40


@pytest.mark.distributed
def test_ranks_started_with_other_settings_are_one_line_not_a_hang(tmp_path):
    """torchrun / srun run one command per node: a node given --steps 3 and another --steps 2 hung at the shorter
    run's end (gloo's 30-minute timeout), and --lr differing per node trained silently. Now one line, exit 2."""
    plan = plan_dict(pp=1, dp=2, ep=2, steps=2)
    port = {"MASTER_PORT": str(_port())}                     # one rendezvous for both "nodes"
    procs = _ranks(2, plan, tmp_path, ranks=[0], env=port) + _ranks(2, plan, tmp_path, "--steps", "3", ranks=[1],
                                                                     env=port)
    codes, err = _finish(procs, timeout=120)
    assert codes == [2, 2], err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert lines == ["error: the ranks were started with different settings: plan.runtime.steps: 2 (rank 0) vs 3 "
                     "(rank 1); allowed: the same plan.json and options on every node"], err[-3000:]


@pytest.mark.distributed
def test_a_rank_that_never_comes_is_one_line_not_a_hang(tmp_path):
    start = time.time()
    codes, err = _finish(_ranks(2, plan_dict(pp=2, dp=1, ep=1), tmp_path, ranks=[0],
                                env={train.RENDEZVOUS_TIMEOUT_ENV: "3"}), timeout=90)
    assert codes == [2] and time.time() - start < 80, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "rank 0 of 2: rendezvous" in lines[0] and "1/2 clients joined" in lines[0], err


@pytest.mark.parametrize("row", [["a", 1, 2, 3], [True, False, 2, 3], [0.0, 1, 2, 3]])
def test_a_slot_map_of_other_types_is_the_damaged_line(row):
    """Before: a str in the saved slot map raised TypeError in sorted() on every rank; booleans passed as 0 / 1."""
    from types import SimpleNamespace

    import torch

    from piper_plan.runtime.checkpoint import _install_slot_maps

    layer = SimpleNamespace(spec=SimpleNamespace(num_experts=4), slot_of_expert=torch.arange(4))
    state = SimpleNamespace(module=SimpleNamespace(moe_layers=lambda: {0: layer}))
    assert "this checkpoint is damaged" in _install_slot_maps(state, {"0": row})
    assert _install_slot_maps(state, {"0": [3, 2, 1, 0]}) is None and layer.slot_of_expert.tolist() == [3, 2, 1, 0]


def test_torchs_gloo_workaround_notice_is_quiet_in_a_cpu_rank():
    """DTensor's 'CPU process group does not support alltoall yet' warning showed once per rank when a gloo run's
    tp group resharded (a resume under another layout): torch's own workaround, nothing the user can act on."""
    import logging

    from torch.distributed.tensor import _collective_utils

    from piper_plan.runtime.train import quiet_gloo_notices

    before = _collective_utils.logger.level
    try:
        quiet_gloo_notices()
        assert not _collective_utils.logger.isEnabledFor(logging.WARNING)
    finally:
        _collective_utils.logger.setLevel(before)
