"""A run directory (`piper run --out-dir`): the files the runtime writes there, the check that it can, the plan it
keeps there and the records a resume keeps. Torch-free and reading files only: `piper run`'s launcher makes the
checks before any rank starts, and every rank makes them again (under torchrun / srun there is no launcher), with
the same answer on every rank."""

from __future__ import annotations

import os
import re
from pathlib import Path

from piper_plan.errors import PiperError

RUN_FILES = ("metrics.jsonl", "summary.json", "plan.json", "checkpoints/latest")
"""The files a run writes in its directory (besides checkpoints/step_<N>/ and profiler traces)."""
IDENTITY_BLOCKS = ("model", "training")
"""plan.json blocks that make a run directory another job's (compare.check_same_job: tokens per step; a
checkpoint holds one model). The rest (parallel, platform, runtime, migration, the prediction) may change between
runs in one directory: a resume under another layout reshards the checkpoint."""
PLANNER_ONLY = {"training": ("tokens_to_train", "routing_skew")}
"""Fields of an identity block only the planner reads (the tokens a whole training takes, the routing skew it
prices): a run resumed with another value is the same run."""


def run_identity(block: str, value):
    """``value`` (a plan's or a checkpoint's ``block``) less its PLANNER_ONLY fields."""
    if not isinstance(value, dict):
        return value
    return {k: v for k, v in value.items() if k not in PLANNER_ONLY.get(block, ())}


def check_run_dir(run_dir: Path) -> None:
    """Every file the run will write in ``run_dir`` can be written: a folder where a file goes (metrics.jsonl,
    summary.json, plan.json, checkpoints/latest), anything but a folder where a folder goes (the run directory,
    checkpoints/), or a path that cannot be written is one PiperError."""
    from piper_plan.fileio import check_folder_path, check_writable

    for folder, what in ((run_dir, "the run directory"), (run_dir / "checkpoints", "the run's checkpoints")):
        if folder.exists() and not folder.is_dir():
            raise PiperError(f"is not a folder; allowed: a folder ({what}); move it aside or use another --out-dir",
                             path=str(folder))
    if not run_dir.is_dir():
        check_folder_path(run_dir, "--out-dir")       # before any rank starts (each failed at its own mkdir)
    targets = [run_dir / name for name in RUN_FILES]
    for path in targets:
        if path.is_dir():
            raise PiperError("is a folder; allowed: the file the run writes there (or none); move it aside or "
                             "use another --out-dir", path=str(path))
    for target in targets if run_dir.exists() else [run_dir, *targets]:   # a new one: its own path first (/proc/x)
        try:
            check_writable(target)
        except PiperError as exc:
            reason = exc.message.removeprefix("cannot write: ").removesuffix("; give a file name")
            raise PiperError(f"cannot write the run there ({reason}); use another --out-dir", path=str(run_dir)) \
                from None


LOCK_FILE = ".piper-run.lock"
"""Held (flock) by `piper run`'s launcher and by each of its ranks while they write the run directory."""
LAUNCHER_PID_ENV = "PIPER_LAUNCHER_PID"
"""Set by `piper run`'s launcher for the ranks it starts: their parent, whose end stops them (runtime/train.py)."""


def check_not_held(run_dir: Path) -> None:
    """hold_run_dir's refusal, without taking the hold or making anything: a live run is named before any check of
    the directory's contents (a second `piper run` there was first told to pass --force, then refused for this)."""
    if is_held(run_dir):
        raise PiperError(HELD, path=str(run_dir))


def is_held(run_dir: Path) -> bool:
    """Whether a local `piper run` (its launcher or ranks) holds ``run_dir`` now; takes no hold."""
    import fcntl

    lock = run_dir / LOCK_FILE
    if not lock.is_file():
        return False
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


HELD = ("another `piper run` is writing this run directory (its launcher, or its ranks, which stop within a step "
        "once their launcher is gone); wait for it to end, or use another --out-dir")


def hold_run_dir(run_dir: Path, launcher: bool) -> int:
    """Hold ``run_dir`` for this process until it exits (an flock on LOCK_FILE; returns its descriptor). The
    launcher (``launcher=True``) first makes sure nothing else holds it: another `piper run` in the same
    directory, or the ranks of one whose launcher is gone (they stop within a step), is one PiperError. Its ranks
    share the hold, so the directory stays held until the last of them ends. Local runs only: torchrun / srun
    ranks on several nodes take none (flock does not span a cluster's file system)."""
    import fcntl

    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if launcher else fcntl.LOCK_SH)   # a rank: its launcher's
    except BlockingIOError:
        os.close(fd)
        raise PiperError(HELD, path=str(run_dir)) from None
    if launcher:
        fcntl.flock(fd, fcntl.LOCK_SH)           # the ranks it starts share the hold
    return fd


def clear_run(run_dir: Path) -> None:
    """`piper run --force`: the run ``run_dir`` holds is gone before the new one starts: its checkpoints (a later
    --resume would otherwise continue the old run under the new one's metrics) and its summary. metrics.jsonl and
    plan.json are rewritten by the new run."""
    import shutil

    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    (run_dir / "summary.json").unlink(missing_ok=True)


def check_replaces_no_run(run_dir: Path, resume: bool) -> None:
    """A run that starts from step 0 replaces the metrics and checkpoints ``run_dir`` holds: refused unless asked
    (``piper run --force``), as ``piper launch`` refuses a non-empty --out-dir. With --resume it starts from step 0
    where no checkpoint is left, so metrics without one are refused then too."""
    step = latest_step(run_dir)
    metrics = (run_dir / "metrics.jsonl").is_file()
    if resume and (step is not None or not metrics):
        return
    if step is None and metrics:
        raise PiperError("holds a run's metrics.jsonl and no checkpoint to continue from: a run here starts from "
                         "step 0 and replaces them; --force does so, or use another --out-dir", path=str(run_dir))
    if step is not None:
        held = f"checkpoints to step {step}" + (" and metrics.jsonl" if metrics else "")
        raise PiperError(f"holds a run ({held}); --resume continues it, --force starts over and replaces them, or "
                         "use another --out-dir", path=str(run_dir))


LATEST_ALLOWED = "a decimal step number (ASCII digits) naming a checkpoints/step_<N> folder, as piper writes it"
LATEST_MAX_BYTES = 4096


def latest_step(run_dir: Path) -> int | None:
    """The step ``checkpoints/latest`` names; None without one. Anything else there (a folder, a dangling link,
    bytes that are not UTF-8, text that is not ASCII digits: '-1', '²') is one PiperError naming the file."""
    from piper_plan.fileio import read_text

    path = Path(run_dir) / "checkpoints" / "latest"
    if not path.exists() and not path.is_symlink():
        return None
    try:
        text = read_text(path, LATEST_MAX_BYTES).strip()
    except PiperError as exc:
        raise PiperError(f"{exc.message}; allowed: {LATEST_ALLOWED}", path=str(path)) from None
    if not re.fullmatch(r"[0-9]{1,18}", text):
        raise PiperError(f"expected a step number, found {text[:40]!r}; allowed: {LATEST_ALLOWED}", path=str(path))
    return int(text)


def plan_change(plan_path: Path, run_dir: Path) -> str | None:
    """Whether this run may keep its plan in ``run_dir``: None when run_dir/plan.json is absent or the same plan; a
    note (one line) when it differs outside IDENTITY_BLOCKS (keep_plan then replaces it, so that `piper compare`
    prices the layout now running); PiperError when run_dir holds another plan's run (another model / training)."""
    from piper_plan.fileio import read_document

    target = run_dir / "plan.json"
    if not target.exists():
        return None
    mine = read_document(plan_path)
    try:
        kept = read_document(target)
    except PiperError as exc:
        raise PiperError(f"{exc.message}; allowed: the plan.json piper run keeps there; move it aside or use "
                         "another --out-dir", path=str(target)) from None
    if kept == mine:
        return None
    labels = ("run directory", "plan")
    for block in IDENTITY_BLOCKS:
        old, new = run_identity(block, kept.get(block)), run_identity(block, mine.get(block))
        named = isinstance(old, dict) and isinstance(new, dict) and old.get("name") != new.get("name")
        diff = (first_difference(old.get("name"), new.get("name"), f"{block}.name", labels) if named
                else first_difference(old, new, block, labels))
        if diff:
            raise PiperError(f"{diff}: {run_dir} holds another plan's run (another {block}); allowed: the same "
                             f"{', '.join(IDENTITY_BLOCKS)} as its plan.json; use another --out-dir", path=str(target))
    diff = first_difference(kept, mine, "", labels)
    return f"{target} replaced by {plan_path} (first difference: {diff})"


def keep_plan(plan_path: Path, run_dir: Path) -> None:
    """A copy of the plan beside metrics.jsonl, so that `piper compare RUN_DIR` finds the prediction (replacing
    the copy of an earlier run of the same job under another layout: plan_change)."""
    from piper_plan.fileio import atomic_write_text, read_text

    target = run_dir / "plan.json"
    text = read_text(plan_path)
    if not target.is_file() or read_text(target) != text:
        atomic_write_text(target, text)


def kept_records(path: Path, start: int) -> list[dict]:
    """metrics.jsonl lines of steps <= start (a run killed after its last checkpoint logged steps it will redo; a
    last record cut short by the kill is one of them: a record is written before its step's checkpoint)."""
    from piper_plan.fileio import json_lines

    if not path.is_file():
        return []
    rows = []
    for number, row in json_lines(path, torn_tail=True):
        if not isinstance(row.get("step"), int) or isinstance(row["step"], bool):
            raise PiperError(f"line {number}: no integer 'step'; allowed: the records piper run writes; move it "
                             "aside to resume without the earlier steps' records", path=str(path))
        rows.append(row)
    return [r for r in rows if r["step"] <= start]


def first_difference(saved, mine, at: str = "", labels: tuple[str, str] = ("checkpoint", "plan")) -> str | None:
    """The first field where two JSON values differ, as ``field: saved vs mine`` (``labels`` name the two sides;
    long values shortened); None if equal."""
    if isinstance(saved, dict) and isinstance(mine, dict):
        for key in sorted(set(saved) | set(mine)):
            found = first_difference(saved.get(key), mine.get(key), f"{at}.{key}" if at else key, labels)
            if found:
                return found
        return None
    if isinstance(saved, list) and isinstance(mine, list) and len(saved) == len(mine):
        return next((d for i, (a, b) in enumerate(zip(saved, mine))
                     if (d := first_difference(a, b, f"{at}[{i}]", labels))), None)
    if saved == mine:
        return None
    return f"{at}: {short_repr(saved)} ({labels[0]}) vs {short_repr(mine)} ({labels[1]})"


def short_repr(value, limit: int = 60) -> str:
    """repr of a value, a mapping or list of more than ``limit`` characters as ``{...}`` / ``[...]`` (one line)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    if isinstance(value, dict):
        return f"{{... {len(value)} fields}}"
    if isinstance(value, list):
        return f"[... {len(value)} items]"
    return text[:limit] + "..."
