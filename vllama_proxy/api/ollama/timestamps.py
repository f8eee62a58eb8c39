"""Ollama's times: ``created_at``/``modified_at``/``expires_at`` strings, the nanosecond clock of durations,
and one request's marks on it (:class:`Timings`).

Ollama writes times as RFC 3339 in UTC with nanosecond digits (Go's ``time.Time`` in JSON,
``2024-07-22T20:38:48.123456789Z``) and durations as integer nanoseconds
(``docs/wire.md`` "Responses").
"""

from __future__ import annotations

import time
from datetime import datetime, timezone


def rfc3339(ts: float) -> str:
    """Seconds since the epoch -> RFC 3339 UTC with nanoseconds, as Ollama's ``created_at``."""
    ns = int(ts * 1e9)
    sec, frac = divmod(ns, 1_000_000_000)
    return datetime.fromtimestamp(sec, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S") + f".{frac:09d}Z"


def now_ns() -> int:
    """Monotonic nanoseconds, the base of every Ollama duration."""
    return time.perf_counter_ns()


class Clock:
    """``created_at`` strings (RFC 3339, UTC, nanoseconds digits) for chunks.

    Formatting costs more than the rest of a chunk's translation, so one string serves
    every chunk of the same 100 µs (chunks of a batch, streams written back to back); the
    seconds part is cached as well. The window is ``[start, start + 100 µs)`` of the wall
    clock, so a clock stepped back (NTP) gets a fresh string at once instead of a frozen one.
    """

    __slots__ = ("_last", "_prefix", "_sec", "_start", "_until")

    def __init__(self) -> None:
        self._sec = -1
        self._prefix = ""
        self._start = 0
        self._until = 0
        self._last = ""

    def now(self) -> str:
        ns = time.time_ns()
        if self._start <= ns < self._until:
            return self._last
        sec, frac = divmod(ns, 1_000_000_000)
        if sec != self._sec:
            self._sec = sec
            self._prefix = datetime.fromtimestamp(sec, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
        self._start = ns
        self._until = ns + 100_000
        self._last = f"{self._prefix}.{frac:09d}Z"
        return self._last


#: The process's one chunk clock (each worker process has its own).
CLOCK = Clock()


class Timings:
    """Monotonic nanosecond marks of one request: received, sent upstream, first and last token;
    for the stage timings also vLLM's response headers and the first body read."""

    __slots__ = ("received", "sent", "first", "last", "headers", "first_read")

    def __init__(self, received: int) -> None:
        self.received = received
        self.sent = received
        self.first = 0
        self.last = 0
        self.headers = 0
        self.first_read = 0
