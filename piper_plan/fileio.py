"""Small file helpers shared by every writer: atomic writes (write a temp file, then rename)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from piper_plan.errors import PiperError


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically: a reader sees the old file or the new one, never half.

    Missing parent folders are created. An OS error (read-only folder, a file where a folder is needed,
    full disk) becomes one PiperError line naming the path; nothing is left behind.
    """
    path = Path(path)
    check_writable(path)
    try:
        return _write_replace(path, text)
    except OSError as exc:
        raise PiperError(f"cannot write: {exc.strerror or exc}", path=str(path)) from None


def check_writable(path: str | Path) -> None:
    """Raise a PiperError now if ``path`` cannot be written later (commands call it before long work)."""
    path = Path(path)
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise PiperError(f"cannot write: {blocker} is a file, not a folder", path=str(path))
    if path.is_dir():
        raise PiperError("cannot write: is a directory; give a file name", path=str(path))
    existing = next(p for p in (path, *path.parents) if p.exists())
    folder = existing if existing.is_dir() else existing.parent
    if not os.access(folder, os.W_OK | os.X_OK) or (existing == path and not os.access(path, os.W_OK)):
        raise PiperError(f"cannot write: {existing} is not writable", path=str(path))


def _write_replace(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())               # mkstemp's 0600 -> what open() would have made
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON, atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")
