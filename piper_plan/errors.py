"""User-facing errors: one clear line, exit code 2 (see DESIGN.md, Conventions)."""

from __future__ import annotations

EXIT_USER_ERROR = 2
EXIT_CHECK_FAILED = 1
"""A check of measurements failed: ``validate`` (a gated row or a dataset's mean outside its tolerance),
``bench a2a --verify`` (HALO differed from all_to_all_single) and ``run`` (the loss went nan / inf). Python's own exit code for a crash is 1 too; piper
never crashes on bad input (that is 2), so 1 with a traceback is a bug to report."""
EXIT_REQUEUE = 75
"""The runtime exits with this (EX_TEMPFAIL, sysexits.h) after checkpointing on SIGUSR1/SIGTERM/SIGINT; the batch
script (launch/render.py) requeues the job on it."""


class PiperError(Exception):
    """A user mistake (bad file, bad value, missing data) with a message fit for one line.

    The message should name the file, the field, the value and what is allowed.
    The CLI prints it as ``error: <message>`` and exits with code 2.
    """

    def __init__(self, message: str, *, path: str | None = None, field: str | None = None):
        self.path = path
        self.field = field
        self.message = message
        """The message without its path and field (to raise it again with the file named)."""
        parts = [p for p in (path, field) if p]
        prefix = ": ".join(parts)
        super().__init__(f"{prefix}: {message}" if prefix else message)


class CountRefused(PiperError):
    """A node count whose whole search space is refused (no dp divides the global batch, no cp divides its world):
    that count has no plan; another may (search.engine.min_nodes moves on)."""
