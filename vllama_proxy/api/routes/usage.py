"""``GET /api/usage``: the usage ledger, summed by key, model and day or month (vllama's own
route, beside Ollama's). An admin key sees every key's usage; a user key its own only."""

from __future__ import annotations

import asyncio
import calendar
import time
from typing import Any

import orjson
from aiohttp import web

from vllama_proxy.errors import BadRequest, Forbidden, NotSupported
from ..app_state import KEYS, LEDGER
from ..policy.budgets import budget_of
from ..policy.keys import key_of


def parse_since(text: str, by: str, now: float) -> float:
    """``since`` (``YYYY-MM-DD`` or ``YYYY-MM``, UTC) as seconds since the epoch; empty: the start of
    this month (``by=day``) or of this year (``by=month``).

    Raises:
        BadRequest: not such a date.
    """
    if not text:
        t = time.gmtime(now)
        return float(calendar.timegm((t.tm_year, t.tm_mon if by == "day" else 1, 1, 0, 0, 0)))
    for fmt in ("%Y-%m-%d", "%Y-%m"):
        try:
            return float(calendar.timegm(time.strptime(text, fmt)))
        except ValueError:
            continue
    raise BadRequest(f"since: '{text}' is not a date: give YYYY-MM-DD or YYYY-MM (UTC)")


async def usage(request: web.Request) -> web.Response:
    """``GET /api/usage?since=YYYY-MM-DD&by=day|month&key=NAME``.

    Returns ``{"since": "2026-11-01", "by": "day", "usage": [{"period", "key", "model", "requests",
    "errors", "prompt_tokens", "output_tokens", "duration_ms"}], "budgets": [{"key", "budget_tokens",
    "period", "used", "resets_at"}]}``: ``usage`` from the ledger (this process's rows written
    first, so the answer holds every request it answered; other workers' within
    ``--usage-flush-interval``), ``budgets`` of the keys it may see that have one.

    Raises:
        BadRequest: ``by`` or ``since`` malformed.
        Forbidden: a user key asking for another key's usage.
        NotSupported: ``--usage-db off``.
    """
    ledger = request.app.get(LEDGER)
    if ledger is None or ledger.store is None:
        raise NotSupported("the usage ledger is off on this server (--usage-db off)")
    by = request.query.get("by", "day")
    if by not in ("day", "month"):
        raise BadRequest(f"by: '{by}' is not one of day, month")
    since = parse_since(request.query.get("since", ""), by, ledger.clock())
    caller = key_of(request)
    wanted = request.query.get("key") or None
    if not caller.admin:
        if wanted not in (None, caller.name):
            raise Forbidden(f"key '{caller.name}' (role {caller.role}) may only see its own usage: that needs an admin key")
        wanted = caller.name
    await ledger.flush()
    rows = await asyncio.to_thread(ledger.store.summary, since, by, wanted)
    ring = request.app[KEYS]
    visible = [k for k in ring.keys if wanted is None or k.name == wanted]
    budgets = [{"key": k.name, **b} for k in visible if (b := budget_of(ledger, k)) is not None]
    body: dict[str, Any] = {"since": time.strftime("%Y-%m-%d", time.gmtime(since)), "by": by, "usage": rows, "budgets": budgets}
    return web.Response(body=orjson.dumps(body), content_type="application/json")

