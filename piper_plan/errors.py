"""User-facing errors: one clear line, exit code 2 (see DESIGN.md, Conventions)."""

from __future__ import annotations

EXIT_USER_ERROR = 2
EXIT_REQUEUE = 75
"""The runtime exits with this (EX_TEMPFAIL, sysexits.h) after checkpointing on SIGUSR1/SIGTERM; the batch
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
