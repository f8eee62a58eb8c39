"""``/api/keys``: mint, list, change, rotate and revoke API keys without editing a file (admin keys only:
``route_roles.py``); the ``/admin`` page's forms call the same functions (``routes/admin.py``). The routes,
their bodies and answers, an entry's fields and the errors are in ``docs/api.md`` "Keys".

A key's settings are the keys file's fields but the secret (``policy/keys.py``'s ``KeySettings``). The keys live
hashed in the usage database (``policy/key_store.py``); the keys file's stay as they are and are listed read-only
(409 on a change). Invariants: a secret is shown once, when it is minted or rotated, and never an entry's secret
or hash afterwards; a rotated or revoked secret is refused from then on; every change is in the audit log with
who made it. ``expires_at`` takes RFC 3339 or seconds since the epoch, ``expires_in`` a duration or seconds.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import time
from typing import Any

import orjson
from aiohttp import web
from pydantic import ConfigDict, Field, ValidationError

from vllama_proxy.errors import BadRequest, KeyNameTaken, KeyNotFound, NotSupported
from ..policy.keys import NAME_PATTERN, Key, KeyRing, KeySettings, key_of, settings_of_row
from ..app_state import KEY_STORE, KEYS
from ..policy.key_store import SPEC_FIELDS, KeyConflict, KeyMissing, KeyStore
from ..usage.ledger import iso
from ..ollama.types import json_object, validation_message
from ..request.body_reader import read_body

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class KeyFields(KeySettings):
    """A create or change request's body: :class:`KeySettings` (``name`` left out of a change, every field optional
    there) and ``expires_in``, a duration instead of ``expires_at``."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, min_length=1, max_length=64, pattern=NAME_PATTERN)  # type: ignore[assignment]
    expires_in: float | str | None = None


def parse_expiry(expires_at: Any, expires_in: Any, now: float) -> float | None:
    """Seconds since the epoch from ``expires_at`` (a datetime, RFC 3339, or epoch seconds) or ``expires_in``
    (``30d``...).

    Raises:
        BadRequest: neither a time nor a duration, both given, or a time in the past.
    """
    if expires_at is not None and expires_in is not None:
        raise BadRequest("give expires_at or expires_in, not both")
    if expires_in is not None:
        m = _DURATION.match(str(expires_in))
        if not m:
            raise BadRequest(f"expires_in: '{expires_in}' is not a duration such as 30d, 12h, 90m or a number of seconds")
        return now + float(m[1]) * _UNITS[m[2]]
    if expires_at is None or expires_at == "":
        return None
    if isinstance(expires_at, dt.datetime):
        t = expires_at.timestamp()
    elif isinstance(expires_at, (int, float)):
        t = float(expires_at)
    else:
        try:
            when = dt.datetime.fromisoformat(str(expires_at).replace("Z", "+00:00"))
        except ValueError:
            raise BadRequest(f"expires_at: '{expires_at}' is not a time: give RFC 3339, e.g. 2026-12-31T00:00:00Z") from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.timezone.utc)
        t = when.timestamp()
    if t <= now:
        raise BadRequest(f"expires_at: {iso(t)} is in the past")
    return t


def _store(request: web.Request) -> KeyStore:
    store = request.app.get(KEY_STORE)
    if store is None:
        raise NotSupported("minted keys live in the usage database, which is off on this server (--usage-db off)")
    return store  # type: ignore[return-value]


def _when(t: float | None) -> str | None:
    return None if t is None else iso(t)


def entry_of_file(key: Key, now: float) -> dict[str, Any]:
    """A keys-file key as the list shows it: every :data:`SPEC_FIELDS` as the :class:`Key` has it."""
    state = "expired" if key.expires_at is not None and key.expires_at <= now else "active"
    return {"name": key.name, "source": "file", "read_only": True, "state": state, "prefix": None,
            **{f: list(key.models) if f == "models" else getattr(key, f) for f in SPEC_FIELDS},
            "expires_at": _when(key.expires_at), "note": key.note, "created_at": None, "created_by": None,
            "updated_at": None, "updated_by": None}


def entry_of_row(row: dict[str, Any], now: float) -> dict[str, Any]:
    """A minted key's row as the list shows it (never its hash); a field the row was stored without shows its default."""
    state = ("revoked" if row["revoked_at"] is not None else
             "expired" if row["expires_at"] is not None and row["expires_at"] <= now else "active")
    spec = settings_of_row(row).model_dump(include=set(SPEC_FIELDS))
    return {"name": row["name"], "source": "api", "read_only": False, "state": state, "prefix": row["prefix"], **spec,
            "expires_at": _when(row["expires_at"]), "revoked_at": _when(row["revoked_at"]), "note": row["note"],
            "created_at": _when(row["created_at"]), "created_by": row["created_by"],
            "updated_at": _when(row["updated_at"]), "updated_by": row["updated_by"]}


async def list_entries(app: web.Application) -> list[dict[str, Any]]:
    """Every key: the file's (read-only), then the minted ones, each sorted by name."""
    ring: KeyRing = app[KEYS]
    now = time.time()
    out = [entry_of_file(k, now) for k in sorted(ring.keys, key=lambda k: k.name) if k.source == "file"]
    store = app.get(KEY_STORE)
    if store is not None:
        out += [entry_of_row(r, now) for r in await asyncio.to_thread(store.rows)]
    return out


def _fields(data: dict[str, Any]) -> KeyFields:
    try:
        return KeyFields.model_validate(data)
    except ValidationError as e:
        raise BadRequest(validation_message(e)) from None


async def _reload(app: web.Application, store: KeyStore) -> None:
    """This worker takes the change at once (the others at their next poll: ``key_store.follow``)."""
    app[KEYS].set_minted(await asyncio.to_thread(store.rows))


async def create_key(app: web.Application, data: dict[str, Any], who: str) -> tuple[str, dict[str, Any]]:
    """Mint a key from a create request's fields: ``(secret, entry)``.

    Raises:
        BadRequest: a field malformed, no name; or a first key on an open server that is not an admin's.
        KeyNameTaken: the name is taken (minted, revoked or the keys file's).
        NotSupported: no usage database.
    """
    store = app.get(KEY_STORE)
    if store is None:
        raise NotSupported("minted keys live in the usage database, which is off on this server (--usage-db off)")
    f = _fields(data)
    if not f.name:
        raise BadRequest("name: a key needs a name (letters, digits, . _ @ : -)")
    ring: KeyRing = app[KEYS]
    if f.name in ring.file_names():
        raise KeyNameTaken(f"key '{f.name}' is in the keys file: change it there")
    if not ring.configured and f.role != "admin":
        raise BadRequest("the server has no key yet (it is open to anyone): its first key must be an admin's, "
                         "or nobody could manage keys once it is made")
    expires = parse_expiry(f.expires_at, f.expires_in, time.time())
    settings = KeySettings.model_validate({**f.model_dump(include=set(KeySettings.model_fields)), "expires_at": expires})
    try:
        secret, row = await asyncio.to_thread(store.create, settings, who)
    except KeyConflict:
        raise KeyNameTaken(f"key '{f.name}' exists already (a revoked key keeps its name)") from None
    await _reload(app, store)
    return secret, entry_of_row(row, time.time())


def _check_minted(app: web.Application, name: str) -> KeyStore:
    store = app.get(KEY_STORE)
    if store is None:
        raise NotSupported("minted keys live in the usage database, which is off on this server (--usage-db off)")
    if name in app[KEYS].file_names():
        raise KeyNameTaken(f"key '{name}' is in the keys file, read-only here: change it there")
    return store  # type: ignore[return-value]


async def update_key(app: web.Application, name: str, data: dict[str, Any], who: str) -> dict[str, Any]:
    """Change a minted key's scope, limits, expiry or note (only the fields in ``data``): its entry.

    Raises:
        BadRequest: a field malformed (or ``name`` given: a key keeps its name).
        KeyNotFound, KeyNameTaken, NotSupported: as the module docstring says.
    """
    store = _check_minted(app, name)
    if "name" in data:
        raise BadRequest("name: a key keeps its name (revoke it and mint another)")
    f = _fields(data)
    changes: dict[str, Any] = {k: getattr(f, k) for k in data if k in SPEC_FIELDS or k == "note"}
    if "expires_at" in data or "expires_in" in data:
        changes["expires_at"] = parse_expiry(f.expires_at, f.expires_in, time.time())
    try:
        row = await asyncio.to_thread(store.update, name, changes, who)
    except KeyMissing:
        raise KeyNotFound(f"no key '{name}' to change (or it was revoked)") from None
    await _reload(app, store)
    return entry_of_row(row, time.time())


async def rotate_key(app: web.Application, name: str, who: str) -> tuple[str, dict[str, Any]]:
    """A new secret for a minted key: ``(secret, entry)``. Raises as :func:`update_key`."""
    store = _check_minted(app, name)
    try:
        secret, row = await asyncio.to_thread(store.rotate, name, who)
    except KeyMissing:
        raise KeyNotFound(f"no key '{name}' to rotate (or it was revoked)") from None
    await _reload(app, store)
    return secret, entry_of_row(row, time.time())


async def revoke_key(app: web.Application, name: str, who: str) -> dict[str, Any]:
    """Revoke a minted key for good: its entry. Raises as :func:`update_key`."""
    store = _check_minted(app, name)
    try:
        row = await asyncio.to_thread(store.revoke, name, who)
    except KeyMissing:
        raise KeyNotFound(f"no key '{name}' to revoke (or it was revoked already)") from None
    await _reload(app, store)
    return entry_of_row(row, time.time())


async def audit_entries(app: web.Application, limit: int = 100) -> list[dict[str, Any]]:
    """The admin actions on keys, newest first (``time`` RFC 3339 beside ``ts``)."""
    store = app.get(KEY_STORE)
    if store is None:
        return []
    return [{**a, "time": iso(a["ts"])} for a in await asyncio.to_thread(store.audit, limit)]


def _json(body: Any) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await read_body(request)
    return json_object(raw) if raw.strip() else {}


async def list_keys(request: web.Request) -> web.Response:
    """``GET /api/keys``."""
    _store(request)
    return _json({"keys": await list_entries(request.app)})


async def create(request: web.Request) -> web.Response:
    """``POST /api/keys``."""
    secret, entry = await create_key(request.app, await _body(request), key_of(request).name)
    return _json({"key": entry, "secret": secret})


async def update(request: web.Request) -> web.Response:
    """``PATCH /api/keys/{name}``."""
    entry = await update_key(request.app, request.match_info["name"], await _body(request), key_of(request).name)
    return _json({"key": entry})


async def rotate(request: web.Request) -> web.Response:
    """``POST /api/keys/{name}/rotate``."""
    await read_body(request)
    secret, entry = await rotate_key(request.app, request.match_info["name"], key_of(request).name)
    return _json({"key": entry, "secret": secret})


async def revoke(request: web.Request) -> web.Response:
    """``DELETE /api/keys/{name}``, ``POST /api/keys/{name}/revoke``."""
    await read_body(request)
    return _json({"key": await revoke_key(request.app, request.match_info["name"], key_of(request).name)})


async def audit(request: web.Request) -> web.Response:
    """``GET /api/keys/audit?limit=N`` (1..1000, default 100)."""
    _store(request)
    try:
        limit = max(1, min(1000, int(request.query.get("limit", "100"))))
    except ValueError:
        raise BadRequest("limit: give a number") from None
    return _json({"audit": await audit_entries(request.app, limit)})
