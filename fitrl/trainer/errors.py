"""Exceptions that end a run with a message instead of a traceback (kept import-light for the CLI)."""


class RunStopped(RuntimeError):
    """The run cannot continue as configured; the message says why and what to change."""
