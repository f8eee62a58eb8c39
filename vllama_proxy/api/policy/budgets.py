"""Token budgets per key: ``budget_tokens`` per ``budget_period`` (``day`` or ``month``,
UTC) in the keys file (``api/policy/keys.py``), checked when a request is admitted (``admission.py``).

Usage comes from the ledger's running totals (``ledger.py``), so the check is a few dict reads, never a
database round trip. An admitted request reserves its worst case (prompt estimate + capped output) in
:class:`Reservations`, shared by every worker, until the settler gives it back and its use is in the
ledger. Invariant: a key is refused once usage plus reservations *reached* the budget, so requests
sent at once overrun it by at most one reservation (other workers' and fronts' usage arrives within
one ``--usage-refresh-interval``).
"""

from __future__ import annotations

from typing import Any

from vllama_proxy.ipc.arrays import spawn_context
from vllama_proxy.errors import BudgetExhausted, TooManyRequests
from vllama_proxy.ipc.lock import SharedLock
from .keys import Key
from ..usage.ledger import Ledger, iso, period_bounds


class Reservations:
    """Tokens reserved per key by its requests in flight, in shared memory (every worker's).

    Args:
        keys: per-key counters (``api/policy/keys.py``'s ``KEY_COUNTERS``).
    """

    def __init__(self, keys: int, ctx: Any = None) -> None:
        ctx = spawn_context(ctx)
        self._lock = SharedLock()
        self._reserved = ctx.RawArray("q", keys)

    def reserve(self, ledger: Ledger, key: Key, tokens: int, retry_after: int, now: float | None = None) -> int:
        """Reserve ``tokens`` of ``key``'s budget unless its usage and reservations reached it; returns the
        tokens reserved (0 for a key without a budget).

        Raises:
            BudgetExhausted: its usage reached ``budget_tokens`` (:func:`refuse_over_budget`).
            TooManyRequests: its usage and its requests in flight's reservations reached it: retry when one
                ends (``Retry-After: retry_after``).
        """
        if key.budget_tokens is None:
            return 0
        used = refuse_over_budget(ledger, key, now)
        with self._lock.held():
            held = self._reserved[key.counter]
            if used + held >= key.budget_tokens:
                refused = True
            else:
                refused = False
                self._reserved[key.counter] = held + tokens
        if refused:
            raise _in_flight(key, used, retry_after)
        return tokens

    def refuse_over(self, ledger: Ledger, key: Key, reserved: int, retry_after: int, now: float | None = None) -> None:
        """Refuse ``key`` when its usage and ``reserved`` (what every front's requests in flight reserved before
        this one, in the shared store) reach its budget.

        Raises:
            TooManyRequests: as :meth:`reserve`."""
        if key.budget_tokens is None:
            return
        now = ledger.clock() if now is None else now
        used = ledger.used(key.name, "day" if key.budget_period == "day" else "month", now)
        if used + reserved >= key.budget_tokens:
            raise _in_flight(key, used, retry_after)

    def release(self, key: Key, tokens: int) -> None:
        """A request of ``key`` that reserved ``tokens`` ended (its use is in the ledger now)."""
        if tokens:
            with self._lock.held():
                self._reserved[key.counter] = max(self._reserved[key.counter] - tokens, 0)

    def take(self, slot: int, used: int, most: int, tokens: int) -> bool:
        """Reserve ``tokens`` at counter ``slot`` (an end user's: ``end_users.counter_of``) unless ``used`` and what is
        reserved there reach ``most``; whether it was reserved. Given back by :meth:`give`."""
        with self._lock.held():
            held = self._reserved[slot]
            if used + held >= most:
                return False
            self._reserved[slot] = held + tokens
            return True

    def give(self, slot: int, tokens: int) -> None:
        """Give back what :meth:`take` reserved at ``slot``."""
        if tokens:
            with self._lock.held():
                self._reserved[slot] = max(self._reserved[slot] - tokens, 0)

    def held(self, key: Key) -> int:
        """Tokens ``key``'s requests in flight reserved."""
        return self._reserved[key.counter]


def _in_flight(key: Key, used: int, retry_after: int) -> TooManyRequests:
    return TooManyRequests(f"key '{key.name}' used {used} tokens of its budget of {key.budget_tokens} tokens and its "
                           f"requests in flight may use the other {max(key.budget_tokens - used, 0)}; retry when one ends",
                           retry_after=max(retry_after, 1))


def refuse_over_budget(ledger: Ledger, key: Key, now: float | None = None) -> int:
    """Refuse ``key`` when it used its budget for the current period (as of ``now``, default the ledger's
    clock); else its usage so far, in tokens.

    Raises:
        BudgetExhausted: 429 ``key 'K' used N tokens of its budget of B tokens per day; the budget
            resets at 2026-11-27T00:00:00Z``, ``Retry-After`` the seconds until then.
    """
    if key.budget_tokens is None:
        return 0
    now = ledger.clock() if now is None else now
    period = "day" if key.budget_period == "day" else "month"
    used = ledger.used(key.name, period, now)
    if used >= key.budget_tokens:
        resets = period_bounds(period, now)[1]
        raise BudgetExhausted(f"key '{key.name}' used {used} tokens of its budget of {key.budget_tokens} tokens per "
                              f"{period}; the budget resets at {iso(resets)}", retry_after=max(1, int(resets - now + 0.999)))
    return used


def budget_of(ledger: Ledger | None, key: Key, now: float | None = None) -> dict | None:
    """``{"budget_tokens", "period", "used", "resets_at"}`` of ``key`` (``None`` without a budget):
    ``/api/usage`` and the admin page."""
    if key.budget_tokens is None:
        return None
    now = (ledger.clock() if ledger is not None else 0.0) if now is None else now
    period = "day" if key.budget_period == "day" else "month"
    used = ledger.used(key.name, period, now) if ledger is not None else 0
    return {"budget_tokens": key.budget_tokens, "period": period, "used": used, "resets_at": iso(period_bounds(period, now)[1])}
