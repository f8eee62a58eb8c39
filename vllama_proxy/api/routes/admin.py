"""``/admin``: the operator's page, server-rendered HTML with no script and no build step.

It shows each model and its state, GPU memory, requests in flight per key, each key's tokens this day
and month against its budget, today's requests by key and model, and the last failed requests (the
usage ledger). Only an admin key opens it (anyone on an open server). A browser posts the key once
(``POST /admin/login``, body within 4 KB and ``--body-timeout``) and gets a cookie ``vllama_admin``
(HttpOnly, SameSite=Strict, Path=/admin, Secure on HTTPS, 8 hours) holding the key's name, an expiry
and their HMAC-SHA-256 keyed by the key's digest: valid on any worker, void once the key leaves the
keys file, ended everywhere by ``POST /admin/logout`` (:class:`SignOuts`, a file every worker reads).
Invariants: the key never goes in a URL; the POSTs refuse a foreign ``Origin``; ``frame-ancestors
'none'``, a CSP without scripts, every value HTML-escaped. Scripts may send ``Authorization: Bearer``.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import hmac
import html
import os
import time
import urllib.parse
from pathlib import Path
from typing import Any

from aiohttp import web

from vllama_proxy.errors import Forbidden, Unauthorized
from vllama_proxy.supervisor import gpu
from ..app_state import ADMISSION, CATALOG, KEYS, LEDGER, SETTINGS
from ..policy.budgets import budget_of
from ..policy.keys import KEY, OPEN, Key, KeyRing
from ..usage.ledger import iso, period_bounds
from ..request.body_reader import read_body

COOKIE = "vllama_admin"
#: The app's sign-outs (:class:`SignOuts`, ``api/app.py`` makes it).
SIGN_OUTS = web.AppKey("admin_sign_outs", object)
#: Seconds a sign-in lasts.
COOKIE_AGE = 8 * 3600
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY", "Cache-Control": "no-store", "Referrer-Policy": "same-origin", "X-Content-Type-Options": "nosniff",
}
_STYLE = """body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;margin:.5em 0 1.5em}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}th{background:#f3f3f3}.n{text-align:right}
.bar{width:12em;height:.9em;background:#eee;border:1px solid #bbb}.bar div{height:100%;background:#4a8}.over div{background:#c44}
form.inline{display:inline}h2{margin-top:1.2em}"""


def _sign(digest: str, name: str, expires: int) -> str:
    return hmac.new(bytes.fromhex(digest), f"{name}.{expires}".encode(), hashlib.sha256).hexdigest()


def cookie_key(ring: KeyRing, value: str, now: float, signed_out: SignOuts | None = None) -> Key | None:
    """The key a ``vllama_admin`` cookie was issued to, if it is signed, unexpired, not signed out and the key
    still exists."""
    name, _, rest = value.partition(".")
    expires, _, sig = rest.partition(".")
    found = ring.named(name)
    if found is None or not expires.isdigit() or int(expires) < now:
        return None
    digest, key = found
    if not hmac.compare_digest(sig, _sign(digest, name, int(expires))):
        return None
    return None if signed_out is not None and signed_out.revoked(sig) else key


class SignOuts:
    """The sign-ins ended by ``POST /admin/logout``, kept in ``<state dir>/admin-signouts`` (one signature and
    its expiry a line, written under a lock, pruned as they expire): every worker and every later start reads
    them, so a cookie signed out is refused everywhere, not only by the browser that dropped it. The file is read
    again when it changed (one ``stat`` per ``/admin`` request)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[float, int] | None = None
        self._revoked: frozenset[str] = frozenset()

    def revoked(self, sig: str) -> bool:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return False
        if self._seen != (st.st_mtime, st.st_size):
            self._seen, self._revoked = (st.st_mtime, st.st_size), frozenset(self._lines())
        return sig in self._revoked

    def _lines(self) -> list[str]:
        try:
            return [line.split()[0] for line in self.path.read_text().splitlines() if line.strip()]
        except OSError:
            return []

    def add(self, sig: str, expires: int, now: float) -> None:
        """End the sign-in whose cookie carries ``sig`` (until ``expires``, when the cookie is void anyway)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            kept = []
            if self.path.exists():
                for line in self.path.read_text().splitlines():
                    parts = line.split()
                    if len(parts) == 2 and parts[1].isdigit() and int(parts[1]) >= now:
                        kept.append(line)
            kept.append(f"{sig} {expires}")
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("\n".join(kept) + "\n")
            os.replace(tmp, self.path)


def _caller(request: web.Request) -> Key | None:
    ring = request.app[KEYS]
    if not ring.configured:
        return OPEN
    if KEY in request:  # Authorization: Bearer (api/policy/keys.py found it)
        return request[KEY]
    value = request.cookies.get(COOKIE)
    return cookie_key(ring, value, time.time(), _sign_outs(request)) if value else None


def _sign_outs(request: web.Request) -> SignOuts | None:
    return request.app.get(SIGN_OUTS)  # type: ignore[return-value]


def _same_origin(request: web.Request) -> None:
    origin = request.headers.get("Origin")
    if origin is not None and origin.split("://", 1)[-1] != request.host:
        raise Forbidden("a sign-in from another site is refused")


def _refuse_user(key: Key) -> None:
    if not key.admin:
        raise Forbidden(f"key '{key.name}' (role {key.role}) may not open the admin page: that needs an admin key")


async def login(request: web.Request) -> web.StreamResponse:
    """``POST /admin/login`` (form field ``key``): an admin key gets the cookie and 303 to ``/admin``.

    Raises:
        Unauthorized: no key, or an unknown one.
        Forbidden: a user key, or a post from another origin.
    """
    _same_origin(request)
    body = await read_body(request)  # a few KB at most, within --body-timeout: anyone may post here
    form = urllib.parse.parse_qs(body.decode("utf-8", "replace"), max_num_fields=8)
    token = (form.get("key") or [""])[0].strip()
    ring = request.app[KEYS]
    key = ring.find(token.encode("utf-8", "surrogateescape")) if token else None
    if key is None:
        raise Unauthorized("unknown key: sign in with an admin key")
    _refuse_user(key)
    resp = web.HTTPSeeOther("/admin")
    found = ring.named(key.name)
    if found is not None:
        expires = int(time.time()) + COOKIE_AGE
        resp.set_cookie(COOKIE, f"{key.name}.{expires}.{_sign(found[0], key.name, expires)}", max_age=COOKIE_AGE,
                        path="/admin", httponly=True, samesite="Strict", secure=request.secure)
    raise resp


async def logout(request: web.Request) -> web.StreamResponse:
    """``POST /admin/logout``: the sign-in ends (its cookie refused by every worker from now on: :class:`SignOuts`)
    and the cookie is cleared, 303 to ``/admin``."""
    _same_origin(request)
    await read_body(request)
    value = request.cookies.get(COOKIE)
    if value and cookie_key(request.app[KEYS], value, time.time()) is not None:
        expires, _, sig = value.partition(".")[2].partition(".")
        sign_outs = _sign_outs(request)
        if sign_outs is not None:
            await asyncio.to_thread(sign_outs.add, sig, int(expires), time.time())
    resp = web.HTTPSeeOther("/admin")
    resp.del_cookie(COOKIE, path="/admin")
    raise resp


async def page(request: web.Request) -> web.Response:
    """``GET /admin``: the sign-in form without a key, the page for an admin.

    Raises:
        Forbidden: a user key.
    """
    caller = _caller(request)
    if caller is None:
        return _html("vllama: sign in", '<h1>vllama admin</h1><form method="post" action="/admin/login">'
                     '<label>Admin key <input type="password" name="key" autocomplete="current-password" autofocus></label> '
                     '<button type="submit">Sign in</button></form>')
    _refuse_user(caller)
    return _html("vllama admin", await _body(request, caller))


def _html(title: str, body: str) -> web.Response:
    text = (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'<meta http-equiv="refresh" content="15"><style>{_STYLE}</style></head><body>{body}</body></html>')
    return web.Response(text=text, content_type="text/html", headers=_HEADERS)


def _table(head: list[str], rows: list[list[Any]], numeric: set[int] = frozenset()) -> str:  # type: ignore[assignment]
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f'<td{" class=n" if i in numeric else ""}>{c if isinstance(c, _Raw) else html.escape(str(c))}</td>'
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body or '<tr><td colspan=' + str(len(head)) + '>none</td></tr>'}</table>"


class _Raw(str):
    """Markup made here from escaped parts (a budget bar)."""


def _bar(used: int, budget: int) -> _Raw:
    share = used / budget if budget else 1.0
    over = " over" if share >= 1 else ""
    return _Raw(f'<div class="bar{over}" title="{used} of {budget}"><div style="width:{min(share, 1) * 100:.1f}%"></div></div>')


async def _body(request: web.Request, caller: Key) -> str:
    app = request.app
    ring, ledger, bound, settings = app[KEYS], app.get(LEDGER), app.get(ADMISSION), app[SETTINGS]
    now = time.time()
    parts = [f'<h1>vllama admin</h1><p>Signed in as <b>{html.escape(caller.name)}</b> at {iso(now)} '
             '<form class="inline" method="post" action="/admin/logout"><button>Sign out</button></form></p>']
    models = []
    for b in app[CATALOG].backends:
        board = b.board
        if board is None:
            models.append([b.model.name if b.model else "(upstream)", "served by --upstream", "", ""])
        elif board.served_name:
            models.append([board.served_name, board.state.value, board.in_flight, board.last_error or ""])
    parts.append("<h2>Models</h2>" + _table(["model", "state", "in flight", "last error"], models, {2}))
    mem = await asyncio.to_thread(_gpu_memory) if settings.gpu_check else None
    if mem:
        rows = [[i, f"{(total - free) / 2**30:.1f} GiB", f"{total / 2**30:.1f} GiB", _bar(total - free, total)]
                for i, (free, total) in sorted(mem.items())]
        parts.append("<h2>GPU memory</h2>" + _table(["GPU", "used", "total", ""], rows, {1, 2}))
    else:
        parts.append("<h2>GPU memory</h2><p>no GPU seen (NVML)</p>")
    keys = ring.keys or [OPEN]
    rows = []
    for k in sorted(keys, key=lambda k: k.name):
        day = ledger.used(k.name, "day", now) if ledger else 0
        month = ledger.used(k.name, "month", now) if ledger else 0
        budget = budget_of(ledger, k, now)
        bar: Any = ""
        if budget is not None:
            bar = _Raw(_bar(budget["used"], budget["budget_tokens"]) + html.escape(
                f"{budget['used']} / {budget['budget_tokens']} per {budget['period']}, resets {budget['resets_at']}"))
        in_flight = bound.key_in_flight(k.slot) if bound is not None else ""
        rows.append([k.name, k.role, in_flight, day, month, bar])
    parts.append("<h2>Keys</h2>" + _table(["key", "role", "in flight", "tokens today", "tokens this month", "budget"], rows, {2, 3, 4}))
    if ledger is not None and ledger.store is not None:
        await ledger.flush()
        today = await asyncio.to_thread(ledger.store.summary, period_bounds("day", now)[0], "day")
        parts.append("<h2>Today</h2>" + _table(
            ["key", "model", "requests", "errors", "prompt tokens", "output tokens"],
            [[r["key"], r["model"], r["requests"], r["errors"], r["prompt_tokens"], r["output_tokens"]] for r in today], {2, 3, 4, 5}))
        errors = await asyncio.to_thread(ledger.store.recent_errors, 20)
        parts.append("<h2>Recent errors</h2>" + _table(
            ["time", "key", "model", "route", "status", "error"],
            [[iso(r["ts"]), r["key"], r["model"], r["route"], r["status"], r["error"] or ""] for r in errors], {4}))
    else:
        parts.append("<p>The usage ledger is off (--usage-db off).</p>")
    return "".join(parts)


def _gpu_memory() -> dict[int, tuple[int, int]] | None:
    n = gpu.count()
    return gpu.memory(range(n)) if n else None
