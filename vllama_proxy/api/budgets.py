"""Token budgets per key (issue 39): ``budget_tokens`` per ``budget_period`` (``day`` or ``month``,
UTC) in the keys file (``api_keys.py``), checked when a request is admitted (``admission.py``).

The usage comes from the ledger's running totals (``ledger.py``: the database's totals, read every
``--usage-refresh-interval`` seconds, plus this process's own rows since), so the check is a few
dict reads, never a database round trip. A key is refused once its usage *reached* the budget: the
request that crosses it is answered in full, as LiteLLM's budgets do (the tokens of a request are
only known once it is answered). With several workers or fronts, a key may overrun its budget by
what the others served within one refresh interval.
"""

from __future__ import annotations

from aiohttp import web

from vllama_proxy.errors import BudgetExhausted
from .app_state import LEDGER
from .api_keys import Key
from .ledger import Ledger, iso, period_bounds


def check(request: web.Request, key: Key) -> None:
    """Refuse ``request`` when ``key`` used its budget for the current period.

    Raises:
        BudgetExhausted: 429 ``key 'K' used N tokens of its budget of B tokens per day; the budget
            resets at 2026-11-27T00:00:00Z``, ``Retry-After`` the seconds until then.
    """
    if key.budget_tokens is None:
        return
    ledger = request.app.get(LEDGER)
    if ledger is not None:
        refuse_over_budget(ledger, key)


def refuse_over_budget(ledger: Ledger, key: Key, now: float | None = None) -> None:
    """:func:`check`'s test on ``ledger`` at ``now`` (default the ledger's clock).

    Raises:
        BudgetExhausted: as :func:`check`.
    """
    if key.budget_tokens is None:
        return
    now = ledger.clock() if now is None else now
    period = "day" if key.budget_period == "day" else "month"
    used = ledger.used(key.name, period, now)
    if used >= key.budget_tokens:
        resets = period_bounds(period, now)[1]
        raise BudgetExhausted(f"key '{key.name}' used {used} tokens of its budget of {key.budget_tokens} tokens per "
                              f"{period}; the budget resets at {iso(resets)}", retry_after=max(1, int(resets - now + 0.999)))


def budget_of(ledger: Ledger | None, key: Key, now: float | None = None) -> dict | None:
    """``{"budget_tokens", "period", "used", "resets_at"}`` of ``key`` (``None`` without a budget):
    ``/api/usage`` and the admin page."""
    if key.budget_tokens is None:
        return None
    now = (ledger.clock() if ledger is not None else 0.0) if now is None else now
    period = "day" if key.budget_period == "day" else "month"
    used = ledger.used(key.name, period, now) if ledger is not None else 0
    return {"budget_tokens": key.budget_tokens, "period": period, "used": used, "resets_at": iso(period_bounds(period, now)[1])}
