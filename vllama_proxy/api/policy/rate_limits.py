"""Per-key requests and tokens per minute (``rpm``, ``tpm`` in the keys file), shared by every worker.

As LiteLLM's virtual keys and OpenAI's rate limits: over ``rpm``, or with ``tpm`` (prompt + output)
spent in the wall-clock minute (a fixed window, as LiteLLM's), a key gets 429 with ``Retry-After`` and
OpenAI's ``x-ratelimit-*`` headers (an admitted request carries them too). One counter pair per key
in shared memory, reset by whoever first sees a new minute, under
:class:`~vllama_proxy.ipc.lock.SharedLock`. Tokens are reserved at admission (prompt estimate +
capped output, ``admission.py``) and settled at the end, never per token. Invariant: requests sent at
once cannot each find the minute unspent; it is overspent by at most one request's reservation.
"""

from __future__ import annotations

import math
import time
from typing import Any

from vllama_proxy.ipc.arrays import spawn_context
from vllama_proxy.ipc.lock import SharedLock

#: Seconds in a window.
WINDOW = 60


class RateLimits:
    """Requests and tokens of each key in the current minute.

    Args:
        keys: per-key counters (``keys.KEY_COUNTERS``).
        clock: seconds since the epoch (tests pass their own).
    """

    def __init__(self, keys: int, ctx: Any = None, clock: Any = time.time) -> None:
        ctx = spawn_context(ctx)
        self._lock = SharedLock()
        self._minute = ctx.RawArray("q", keys)  # the window each key's counts belong to
        self._requests = ctx.RawArray("i", keys)
        self._tokens = ctx.RawArray("q", keys)
        self.clock = clock

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("clock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.clock = time.time

    def _roll(self, key: int, now: float) -> None:
        minute = int(now // WINDOW)
        if self._minute[key] != minute:
            self._minute[key], self._requests[key], self._tokens[key] = minute, 0, 0

    def admit(self, key: int, rpm: int | None, tpm: int | None, reserve: int = 0) -> tuple[str | None, dict[str, str], int]:
        """Count one request of key counter ``key`` if it is within ``rpm`` and ``tpm``, and reserve its
        ``reserve`` tokens (its worst case) in the minute when the key has ``tpm``.

        Returns:
            ``(None, headers, minute)`` when admitted, ``(what, headers, minute)`` when refused (``what``: the
            limit reached, ``"rpm"`` or ``"tpm"``); ``headers``: OpenAI's ``x-ratelimit-*`` for the limits the
            key has, plus ``Retry-After`` when refused; ``minute``: the window counted in (:meth:`settle`'s).
            Nothing is counted for a key without limits.
        """
        if rpm is None and tpm is None:
            return None, {}, 0
        now = self.clock()
        minute = int(now // WINDOW)
        with self._lock.held():
            self._roll(key, now)
            used, spent = self._requests[key], self._tokens[key]
            refused = "rpm" if rpm is not None and used >= rpm else "tpm" if tpm is not None and spent >= tpm else None
            if refused is None:
                used = self._requests[key] = used + 1
                if tpm is not None and reserve > 0:
                    self._tokens[key] = spent + reserve
        return refused, headers(rpm, tpm, used, spent, reset_in(now), refused), minute

    def reserve(self, key: int, tokens: int) -> int:
        """Reserve ``tokens`` of ``key``'s minute without checking (the shared store admitted the request and
        reserved them there; this front's minute goes on beside it). Returns the minute."""
        now = self.clock()
        with self._lock.held():
            self._roll(key, now)
            if tokens > 0:
                self._tokens[key] += tokens
        return int(now // WINDOW)

    def settle(self, key: int, reserved: int, minute: int, used: int) -> None:
        """A request of ``key`` that reserved ``reserved`` tokens in ``minute`` ended having used ``used``:
        the reservation becomes the use. In a later minute the use is counted there (the reservation went
        with its minute)."""
        now = self.clock()
        with self._lock.held():
            self._roll(key, now)
            if int(now // WINDOW) == minute:
                self._tokens[key] = max(self._tokens[key] + used - reserved, 0)
            elif used > 0:
                self._tokens[key] += used

    def count(self, key: int) -> None:
        """Count one request of ``key`` without checking it: the shared store (``api/policy/fleet_counters.py``)
        admitted it, and this front's own count goes on, for the minutes the store cannot answer."""
        now = self.clock()
        with self._lock.held():
            self._roll(key, now)
            self._requests[key] += 1

    def used(self, key: int) -> tuple[int, int]:
        """``(requests, tokens)`` of ``key`` in the current minute."""
        with self._lock.held():
            self._roll(key, self.clock())
            return self._requests[key], self._tokens[key]


def reset_in(now: float) -> float:
    """Seconds from ``now`` (since the epoch) to the next window (> 0)."""
    return max(WINDOW - now % WINDOW, 0.001)


def headers(rpm: int | None, tpm: int | None, used: int, spent: int, reset: float, refused: str | None) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers for the limits a key has (``used`` requests, this one
    included when admitted, and ``spent`` tokens this window; ``reset`` seconds to the next), plus
    ``Retry-After`` when ``refused``. Empty for a key with neither limit."""
    out: dict[str, str] = {}
    if rpm is not None:
        out |= {"x-ratelimit-limit-requests": str(rpm), "x-ratelimit-remaining-requests": str(max(rpm - used, 0)),
                "x-ratelimit-reset-requests": _duration(reset)}
    if tpm is not None:
        out |= {"x-ratelimit-limit-tokens": str(tpm), "x-ratelimit-remaining-tokens": str(max(tpm - spent, 0)),
                "x-ratelimit-reset-tokens": _duration(reset)}
    if refused is not None:
        out["Retry-After"] = str(max(math.ceil(reset), 1))
    return out


def _duration(seconds: float) -> str:
    """OpenAI's ``x-ratelimit-reset-*`` form: ``"1s"``, ``"6m0s"``, ``"250ms"``."""
    if seconds < 1:
        return f"{max(int(seconds * 1000), 1)}ms"
    whole = math.ceil(seconds)
    return f"{whole // 60}m{whole % 60}s" if whole >= 60 else f"{whole}s"
