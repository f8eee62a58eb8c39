"""After vLLM failed: how long before the next start, and whether it is a crash loop, as a pure decider.

Restarts back off exponentially (``--restart-backoff-initial`` doubled per failure in a row, at most
``--restart-backoff-max``); ``--crash-loop-limit`` failures in a row make the state ``failed``, retried
every ``--failed-retry-interval``. A vLLM that ran ``--restart-reset-after`` seconds before it failed
starts the count afresh. The supervisor (``lifecycle.py``) counts the failures and waits.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """``crash_loop``: the state becomes ``failed`` (else ``restarting``); ``delay``: seconds before the next start."""

    crash_loop: bool
    delay: float


def backoff(failures: int, *, crash_loop_limit: int, initial: float, cap: float, failed_retry: float) -> Backoff:
    """The wait after the ``failures``-th failure in a row (1 for the first)."""
    if failures >= crash_loop_limit:
        return Backoff(True, failed_retry)
    return Backoff(False, min(initial * 2 ** (failures - 1), cap))


def failures_before(failures: int, ran: float, reset_after: float) -> int:
    """The failures in a row before a ready vLLM's crash: none once it ran ``ran`` >= ``reset_after``
    seconds (not part of a crash loop), else ``failures``."""
    return 0 if ran >= reset_after else failures
