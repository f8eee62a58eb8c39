"""``/admin``: the operator's page, server-rendered HTML with no script and no build step.

It shows the models, GPU memory, requests in flight, each key's tokens against its budget and the usage
ledger's requests; it mints and changes keys through ``routes/keys.py``'s functions, and frames the live
data (``GET /admin/live``). A browser posts an admin key once and gets a signed cookie that any worker
checks (:func:`cookie_key`), void once the key is rotated, revoked, expired or gone; ``POST
/admin/logout`` ends it everywhere (:class:`SignOuts`). ``admin_oidc.py`` signs people in the same way.
Invariants: the key never goes in a URL; the POSTs refuse a foreign ``Origin`` and carry
:func:`csrf_token`; rotating and revoking need the ``confirm`` box; no framing, no scripts (CSP), every
value HTML-escaped. Routes and cookies: ``docs/operations.md`` "The page's routes and cookies".
"""

from __future__ import annotations

import asyncio
import base64
import binascii
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

from vllama_proxy.errors import BadRequest, Forbidden, Unauthorized, VllamaError
from vllama_proxy.supervisor import gpu
from . import keys as key_admin
from ..app_state import ADMISSION, CATALOG, KEY_STORE, KEYS, LEDGER, SETTINGS
from ..policy.budgets import budget_of
from ..policy.keys import KEY, OPEN, Key, KeyRing
from ..usage.ledger import iso, period_bounds
from ..request.body_reader import read_body

COOKIE = "vllama_admin"
#: The app's sign-outs (:class:`SignOuts`, ``api/app.py`` makes it).
SIGN_OUTS = web.AppKey("admin_sign_outs", object)
#: The app's OpenID Connect sign-in (``admin_oidc.OidcSignIn``; absent: none configured).
OIDC = web.AppKey("admin_oidc", object)
#: Seconds a sign-in lasts.
COOKIE_AGE = 8 * 3600
#: The first character of an OpenID Connect sign-in's name in the cookie (never a key's: ``keys.NAME_PATTERN``).
OIDC_MARK = "~"
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-src 'self'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY", "Cache-Control": "no-store", "Referrer-Policy": "same-origin", "X-Content-Type-Options": "nosniff",
}
#: ``/admin/live``, the data the page frames: framed by the page alone, refreshed every 15 s.
_LIVE_HEADERS = {**_HEADERS, "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'self'",
                 "X-Frame-Options": "SAMEORIGIN"}
_STYLE = """body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;margin:.5em 0 1.5em}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}th{background:#f3f3f3}.n{text-align:right}
.bar{width:12em;height:.9em;background:#eee;border:1px solid #bbb}.bar div{height:100%;background:#4a8}.over div{background:#c44}
form.inline{display:inline}h2{margin-top:1.2em}iframe{width:100%;height:60vh;border:1px solid #ccc}
.msg{padding:.5em;border:1px solid #c44;background:#fee}.secret{padding:.5em;border:1px solid #4a8;background:#efe;font-family:monospace}
input.s{width:6em}"""


def _sign(secret: bytes, name: str, expires: int) -> str:
    return hmac.new(secret, f"{name}.{expires}".encode(), hashlib.sha256).hexdigest()


def _session(ring: KeyRing, name: str, oidc: Any = None) -> tuple[bytes, Key] | None:
    """The signing secret and the :class:`Key` of a cookie's ``name``: a key's digest and the key, or for an OpenID
    Connect sign-in (``~`` + base64url of the person's name) the client's session key and an admin :class:`Key`
    named after the person (``source`` ``oidc``). ``None``: no such key, or no OpenID Connect configured."""
    if name.startswith(OIDC_MARK):
        if oidc is None:
            return None
        try:
            who = base64.urlsafe_b64decode(name[1:] + "=" * (-len(name[1:]) % 4)).decode()
        except (binascii.Error, ValueError):
            return None
        return oidc.session_key, Key(name=who, role="admin", source="oidc")
    found = ring.named(name)
    return None if found is None else (bytes.fromhex(found[0]), found[1])


def csrf_token(ring: KeyRing, cookie: str, oidc: Any = None) -> str | None:
    """The token the page's forms carry for the sign-in of ``cookie``: an HMAC of the cookie's signature keyed by
    the key's digest (an OpenID Connect sign-in's: the client's session key; ``None`` for a cookie that names no
    key). A page of another site can neither read it nor forge it; it changes with every sign-in and dies with it."""
    name, _, rest = cookie.partition(".")
    sig = rest.partition(".")[2]
    found = _session(ring, name, oidc)
    if found is None:
        return None
    return hmac.new(found[0], f"csrf.{sig}".encode(), hashlib.sha256).hexdigest()


def cookie_key(ring: KeyRing, value: str, now: float, signed_out: SignOuts | None = None, oidc: Any = None) -> Key | None:
    """The key a ``vllama_admin`` cookie was issued to, if it is signed, unexpired, not signed out and the key
    still exists (an OpenID Connect sign-in's: the admin :class:`Key` of :func:`_session`, with ``oidc``)."""
    name, _, rest = value.partition(".")
    expires, _, sig = rest.partition(".")
    found = _session(ring, name, oidc)
    if found is None or not expires.isdigit() or int(expires) < now:
        return None
    secret, key = found
    if not hmac.compare_digest(sig, _sign(secret, name, int(expires))):
        return None
    return None if signed_out is not None and signed_out.revoked(sig) else key


def set_oidc_cookie(resp: web.StreamResponse, oidc: Any, who: str, secure: bool) -> None:
    """Sign ``who`` in (an admin through OpenID Connect: ``admin_oidc.py``): the page's cookie, as a key's sign-in has."""
    name = OIDC_MARK + base64.urlsafe_b64encode(who.encode()).rstrip(b"=").decode()
    expires = int(time.time()) + COOKIE_AGE
    resp.set_cookie(COOKIE, f"{name}.{expires}.{_sign(oidc.session_key, name, expires)}", max_age=COOKIE_AGE,
                    path="/admin", httponly=True, samesite="Strict", secure=secure)


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
    return cookie_key(ring, value, time.time(), _sign_outs(request), request.app.get(OIDC)) if value else None


def _sign_outs(request: web.Request) -> SignOuts | None:
    return request.app.get(SIGN_OUTS)  # type: ignore[return-value]


def _same_origin(request: web.Request) -> None:
    origin = request.headers.get("Origin")
    if origin is not None and origin.split("://", 1)[-1] != request.host:
        raise Forbidden("a sign-in from another site is refused")


def _refuse_user(key: Key) -> None:
    if not key.admin:
        raise Forbidden(f"key '{key.name}' (role {key.role}) may not open the admin page: that needs an admin key")


def sign_in_form(request: web.Request, error: VllamaError | None = None, status: int | None = None) -> web.Response:
    """The sign-in form (no refresh: a half-typed key stays), with ``error``'s message and status (or ``status``)
    when given, and a link to sign in through OpenID Connect where a provider is set (``admin_oidc.py``)."""
    msg = f'<p class="msg" role="alert">{html.escape(error.message)}</p>' if error is not None else ""
    oidc = ('<p><a href="/admin/oidc/login" id="oidc-sign-in">Sign in with OpenID Connect</a></p>'
            if request.app.get(OIDC) is not None else "")
    resp = _html("vllama: sign in", f'<h1>vllama admin</h1>{msg}<form method="post" action="/admin/login">'
                 '<label>Admin key <input type="password" name="key" autocomplete="current-password" autofocus></label> '
                 f'<button type="submit">Sign in</button></form>{oidc}')
    if error is not None:
        resp.set_status(status or error.status)
        resp.headers.update(error.headers)
    return resp


async def login(request: web.Request) -> web.StreamResponse:
    """``POST /admin/login`` (form field ``key``): an admin key gets the cookie and 303 to ``/admin``; no key, an
    unknown one (401) or a user's (403) get the form again with the reason.

    Raises:
        Forbidden: a post from another origin.
    """
    _same_origin(request)
    body = await read_body(request)  # a few KB at most, within --body-timeout: anyone may post here
    form = urllib.parse.parse_qs(body.decode("utf-8", "replace"), max_num_fields=8)
    token = (form.get("key") or [""])[0].strip()
    ring = request.app[KEYS]
    key = ring.find(token.encode("utf-8", "surrogateescape")) if token else None
    if key is None:
        return sign_in_form(request, Unauthorized("unknown key: sign in with an admin key"))
    if not key.admin:
        return sign_in_form(request, Forbidden(f"key '{key.name}' (role {key.role}) may not open the admin page: that needs an admin key"))
    resp = web.HTTPSeeOther("/admin")
    found = ring.named(key.name)
    if found is not None:
        expires = int(time.time()) + COOKIE_AGE
        resp.set_cookie(COOKIE, f"{key.name}.{expires}.{_sign(bytes.fromhex(found[0]), key.name, expires)}", max_age=COOKIE_AGE,
                        path="/admin", httponly=True, samesite="Strict", secure=request.secure)
    raise resp


async def logout(request: web.Request) -> web.StreamResponse:
    """``POST /admin/logout``: the sign-in ends (its cookie refused by every worker from now on: :class:`SignOuts`)
    and the cookie is cleared, 303 to ``/admin``."""
    _same_origin(request)
    await read_body(request)
    value = request.cookies.get(COOKIE)
    if value and cookie_key(request.app[KEYS], value, time.time(), oidc=request.app.get(OIDC)) is not None:
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
        return sign_in_form(request)
    _refuse_user(caller)
    return _html("vllama admin", await _manage(request, caller))


async def live(request: web.Request) -> web.Response:
    """``GET /admin/live``: the page's live data (models, GPU memory, keys' use, today, errors), framed by ``/admin``
    and refreshed there every 15 s, so the forms around it keep what is typed in them.

    Raises:
        Forbidden: a user key.
    """
    caller = _caller(request)
    if caller is None:
        return _html("vllama: signed out", '<p>Signed out: <a href="/admin" target="_top">sign in</a></p>', live=True)
    _refuse_user(caller)
    return _html("vllama admin: live", await _body(request, caller), live=True)


def html_page(title: str, body: str, *, head: str = "") -> web.Response:
    """A page of the admin's (its headers: no script, no framing), ``head`` added to its ``<head>``."""
    return _html(title, body, head=head)


def _html(title: str, body: str, *, live: bool = False, head: str = "") -> web.Response:
    refresh = '<meta http-equiv="refresh" content="15">' if live else head
    text = (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'{refresh}<style>{_STYLE}</style></head><body>{body}</body></html>')
    return web.Response(text=text, content_type="text/html", headers=_LIVE_HEADERS if live else _HEADERS)


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
    parts = [f'<p>As of {iso(now)}</p>']
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
        in_flight = bound.key_in_flight(k.counter) if bound is not None else ""
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


# --- keys, managed from the page (the same functions as /api/keys: routes/keys.py) ---

_LIMITS = (("max_in_flight", "in flight"), ("max_tokens", "max tokens"), ("rpm", "rpm"), ("tpm", "tpm"),
           ("budget_tokens", "budget tokens"), ("priority", "priority"), ("weight", "weight"))
#: A trusted front's end users' limits (``policy/end_users.py``), shown and set with the box that makes a key one.
_USER_LIMITS = (("user_max_in_flight", "per user in flight"), ("user_rpm", "per user rpm"), ("user_tpm", "per user tpm"),
                ("user_budget_tokens", "per user budget"))


def _who(request: web.Request, caller: Key) -> str:
    return caller.name


def _csrf_field(request: web.Request) -> str:
    cookie = request.cookies.get(COOKIE)
    token = csrf_token(request.app[KEYS], cookie, request.app.get(OIDC)) if cookie and KEY not in request else None
    return f'<input type="hidden" name="csrf" value="{html.escape(token)}">' if token else ""


def _opt(name: str, label: str, value: Any = "", cls: str = "s") -> str:
    return (f'<label>{html.escape(label)} <input class="{cls}" name="{name}" value="{html.escape("" if value is None else str(value))}">'
            '</label> ')


def _role_select(current: str = "user") -> str:
    opts = "".join(f'<option{" selected" if r == current else ""}>{r}</option>' for r in ("user", "admin", "metrics"))
    return f'<label>role <select name="role">{opts}</select></label> '


async def _manage(request: web.Request, caller: Key, message: str = "", secret: tuple[str, str] | None = None) -> str:
    """The page: who is signed in, a secret just minted (shown once), the keys with their forms, the audit log,
    and the live data in a frame."""
    app = request.app
    csrf = _csrf_field(request)
    how = " (OpenID Connect)" if caller.source == "oidc" else ""
    parts = [f'<h1>vllama admin</h1><p>Signed in as <b>{html.escape(caller.name)}</b>{how} '
             f'<form class="inline" method="post" action="/admin/logout">{csrf}<button>Sign out</button></form></p>']
    if message:
        parts.append(f'<p class="msg" role="alert">{html.escape(message)}</p>')
    if secret is not None:
        parts.append(f'<p>The secret of <b>{html.escape(secret[0])}</b>, shown this once (copy it now):</p>'
                     f'<p class="secret" id="secret">{html.escape(secret[1])}</p>')
    if app.get(KEY_STORE) is None:
        parts.append("<h2>Keys</h2><p>Minting keys needs the usage database (--usage-db off).</p>")
    else:
        entries = await key_admin.list_entries(app)
        rows = []
        for e in entries:
            limits = ", ".join(f"{label} {e[f]}" for f, label in _LIMITS if e.get(f) not in (None, 0, 1.0) or (f == "priority" and e[f]))
            if e.get("trusted_front"):
                limits = ", ".join(x for x in (limits, "trusted front", *(f"{label} {e[f]}" for f, label in _USER_LIMITS
                                                                          if e.get(f) is not None)) if x)
            if e["read_only"]:
                actions: Any = "keys file (read-only)"
            elif e["state"] == "revoked":
                actions = f"revoked {e['revoked_at']}"
            else:
                n = urllib.parse.quote(e["name"], safe="")
                actions = _Raw(
                    f'<form class="inline" method="post" action="/admin/keys/{n}/update">{csrf}'
                    + _opt("models", "models", ", ".join(e["models"]), cls="m")
                    + _opt("expires_at", "expires", e["expires_at"] or "never", cls="m")
                    + "".join(_opt(f, label, e[f]) for f, label in _LIMITS[:5])
                    + '<button name="do" value="update">Save</button></form> '
                    f'<form class="inline" method="post" action="/admin/keys/{n}/rotate">{csrf}'
                    '<label><input type="checkbox" name="confirm" value="yes" required> sure</label> <button>Rotate</button></form> '
                    f'<form class="inline" method="post" action="/admin/keys/{n}/revoke">{csrf}'
                    '<label><input type="checkbox" name="confirm" value="yes" required> sure</label> <button>Revoke</button></form>')
            rows.append([e["name"], e["source"], e["state"], e["prefix"] or "", e["role"], ", ".join(e["models"]) or "every model",
                         limits, e["expires_at"] or "never", e["note"], actions])
        parts.append("<h2>Keys</h2>" + _table(["key", "source", "state", "prefix", "role", "models", "limits", "expires", "note", ""], rows))
        parts.append('<h2>New key</h2><form method="post" action="/admin/keys" id="new-key">' + csrf
                     + '<label>name <input name="name" required pattern="[A-Za-z0-9._@:-]+"></label> ' + _role_select()
                     + _opt("models", "models", cls="m") + _opt("expires_in", "expires in (30d, 12h)", cls="s")
                     + "".join(_opt(f, label) for f, label in _LIMITS[:5]) + _opt("note", "note", cls="m")
                     + '<label><input type="checkbox" name="trusted_front" value="true"> trusted front (names its end users)</label> '
                     + "".join(_opt(f, label) for f, label in _USER_LIMITS)
                     + '<button type="submit">Create</button></form>')
        audit = await key_admin.audit_entries(app, 50)
        parts.append("<h2>Audit log</h2>" + _table(
            ["time", "who", "action", "key", "detail"],
            [[a["time"], a["who"], a["action"], a["key"], ", ".join(f"{k}={v}" for k, v in a["detail"].items())] for a in audit]))
    parts.append('<h2>Now</h2><iframe src="/admin/live" title="live data"></iframe>')
    return "".join(parts)


def _form_fields(form: dict[str, list[str]], update: bool) -> dict[str, Any]:
    """A key form's fields as ``/api/keys`` takes them: empty fields left out (a change keeps them), ``models``
    split on commas, numbers read, ``expires_at`` ``never`` cleared.

    Raises:
        BadRequest: a number that is not one.
    """
    out: dict[str, Any] = {}
    ints = {f for f, _ in _LIMITS + _USER_LIMITS}
    for name in ("name", "role", "note", "expires_in", "expires_at", "models", *ints, "budget_period", "trusted_front"):
        value = (form.get(name) or [""])[0].strip()
        if name == "models":
            if value or not update:
                out["models"] = [m.strip() for m in value.replace(" ", ",").split(",") if m.strip() and m.strip() != "every"]
            continue
        if not value:
            continue
        if name == "expires_at" and value == "never":
            out["expires_at"] = None
        elif name in ("weight",):
            try:
                out[name] = float(value)
            except ValueError:
                raise BadRequest(f"{name}: '{value}' is not a number") from None
        elif name == "trusted_front":
            out[name] = value == "true"
        elif name in ints:
            try:
                out[name] = int(value)
            except ValueError:
                raise BadRequest(f"{name}: '{value}' is not a whole number") from None
        else:
            out[name] = value
    return out


async def _form_caller(request: web.Request) -> tuple[Key, dict[str, list[str]]]:
    """The signed-in admin posting a key form, and the form. CSRF: the post must come from this page's origin
    and carry the sign-in's :func:`csrf_token` (a bearer-key script sends none: a browser adds no Authorization
    to another site's form).

    Raises:
        Unauthorized: not signed in. Forbidden: a user key, another origin, no or a wrong token.
    """
    _same_origin(request)
    body = await read_body(request)
    form = urllib.parse.parse_qs(body.decode("utf-8", "replace"), max_num_fields=32)
    caller = _caller(request)
    if caller is None:
        raise Unauthorized("sign in first")
    _refuse_user(caller)
    if KEY not in request:
        if request.app[KEYS].configured:
            cookie = request.cookies.get(COOKIE, "")
            want = csrf_token(request.app[KEYS], cookie, request.app.get(OIDC)) if cookie else None
            got = (form.get("csrf") or [""])[0]
            if want is None or not hmac.compare_digest(want, got):
                raise Forbidden("the form's token is missing or stale: reload the page and try again")
        elif request.headers.get("Origin") is None:  # an open server: no cookie to bind a token to
            raise Forbidden("a form post without an Origin header is refused")
    return caller, form


async def _answer(request: web.Request, caller: Key, coro: Any) -> web.Response:
    """Run a key action; its failure answers the page with the message and the error's status."""
    try:
        return await coro
    except VllamaError as e:
        resp = _html("vllama admin", await _manage(request, caller, message=e.message))
        resp.set_status(e.status)
        return resp


async def key_create(request: web.Request) -> web.StreamResponse:
    """``POST /admin/keys`` (the new-key form): the page with the secret, shown once."""
    caller, form = await _form_caller(request)

    async def act() -> web.Response:
        secret, entry = await key_admin.create_key(request.app, _form_fields(form, update=False), _who(request, caller))
        return _html("vllama admin", await _manage(request, caller, message="", secret=(entry["name"], secret)))

    return await _answer(request, caller, act())


async def key_action(request: web.Request) -> web.StreamResponse:
    """``POST /admin/keys/{name}/update|rotate|revoke``: a change (303 to ``/admin``), a rotation (the page with the
    new secret), a revocation (303). Rotating and revoking need the form's ``confirm`` box ticked."""
    caller, form = await _form_caller(request)
    name, action = request.match_info["name"], request.match_info["action"]
    who = _who(request, caller)

    async def act() -> web.Response:
        if action in ("rotate", "revoke") and (form.get("confirm") or [""])[0] != "yes":
            raise BadRequest(f"tick 'sure' to {action} key '{name}'")
        if action == "update":
            await key_admin.update_key(request.app, name, _form_fields(form, update=True), who)
        elif action == "revoke":
            await key_admin.revoke_key(request.app, name, who)
        else:
            secret, _ = await key_admin.rotate_key(request.app, name, who)
            return _html("vllama admin", await _manage(request, caller, secret=(name, secret)))
        raise web.HTTPSeeOther("/admin")

    return await _answer(request, caller, act())
