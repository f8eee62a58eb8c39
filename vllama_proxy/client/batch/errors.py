"""What stops a whole ``vllama batch`` run."""

from __future__ import annotations


class BatchError(Exception):
    """A problem that stops the whole run before or instead of sending (exit code 1)."""

