"""End users as sub-tenants of a key: the people behind a trusted front end (Open WebUI) that uses one key.

A key marked ``trusted_front`` (``keys.py``; ``docs/configuration.md`` "Many users") names each
request's end user: its ``user_header`` (default ``X-OpenWebUI-User-Id``), else with ``user_body`` OpenAI's
``user``/``safety_identifier`` or Anthropic's ``metadata.user_id``, else :data:`ANONYMOUS`. The gate reads it once
(``Call.end_user``). It gets a fair-queue counter under its key (the key's weight split between its active users),
the key's ``user_*`` limits (``request/admission.py``; over every front with ``--state-url``: :func:`store_name`),
the ledger's ``end_user`` column and the access log's (:func:`log_name`). Invariants: any other key's header and body fields are ignored for tenancy, never refused (OpenAI
clients send ``user`` routinely; ignoring leaves the key's limits and share as they are; ``user`` still goes to vLLM);
the prefix-cache salt stays the key's (a front's users share its system prompts).
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any

from aiohttp import web

from vllama_proxy.errors import BadRequest
from .keys import KEY_COUNTERS, Key

#: The end user of a trusted front's request that names none.
ANONYMOUS = "(anonymous)"
#: Counters for end users in the fair queue and the per-user limits, after the keys' :data:`~.api_keys.KEY_COUNTERS`
#: (two users hashed to one counter share their limits and their share: they only hold tighter).
USER_COUNTERS = 4096
#: The longest end-user id taken (Open WebUI's are UUIDs; an e-mail address fits).
MAX_LENGTH = 256


def end_user(request: web.Request, key: Key, typed: Any) -> str | None:
    """The end user a request of ``key`` is made for: ``None`` for a key that is not a
    trusted front, :data:`ANONYMOUS` for a trusted front's request that names none.

    Raises:
        BadRequest: a trusted front names one longer than :data:`MAX_LENGTH` characters or with control characters.
    """
    if not key.trusted_front:
        return None
    found = request.headers.get(key.user_header) if key.user_header else None
    if not found and key.user_body:
        found = _from_body(typed)
    if not found:
        return ANONYMOUS
    found = found.strip()
    if len(found) > MAX_LENGTH or not found.isprintable():
        raise BadRequest(f"invalid end user: at most {MAX_LENGTH} printable characters", param="user")
    return found or ANONYMOUS


def _from_body(typed: Any) -> str | None:
    if typed is None:
        return None
    get = typed.get if isinstance(typed, dict) else (lambda f: (getattr(typed, "__pydantic_extra__", None) or {}).get(f, getattr(typed, f, None)))
    for name in ("user", "safety_identifier"):
        value = get(name)
        if isinstance(value, str) and value:
            return value
    metadata = get("metadata")
    if isinstance(metadata, dict):
        value = metadata.get("user_id")
        if isinstance(value, str) and value:
            return value
    return None


def counter_of(key: Key, user: str) -> int:
    """The end user's counter (fair queue, per-user limits): ``KEY_COUNTERS + CRC-32(key name, user) % USER_COUNTERS``."""
    return KEY_COUNTERS + zlib.crc32(f"{key.name}\0{user}".encode()) % USER_COUNTERS


def store_name(key: Key, user: str) -> str:
    """The end user's name in a fleet's shared store (``--state-url``: ``fleet_counters.py``), where its ``user_*``
    limits count over every front: ``<key name>/<user>`` (``/`` is not in key names: no user of one key meets
    another key's), the user as :func:`log_name` shows it (hashed for a key with ``hash_end_users``)."""
    return f"{key.name}/{log_name(key, user)}"


def log_name(key: Key, user: str | None) -> str | None:
    """What the access log shows of ``user``: as given, or with the key's ``hash_end_users`` 16 hex characters of
    BLAKE2b keyed with a secret of the key's (``Key.user_hash_key``: BLAKE2b of its name keyed with the SHA-256 of
    its secret, as ``cache_salt.of_key``), personalisation ``vllama-user``: the same user is the same name in every
    line, and nobody without the key's secret can tell which id it was."""
    if user is None or not key.hash_end_users:
        return user
    secret = key.user_hash_key or key.name.encode()[:64]
    return hashlib.blake2b(user.encode(), key=secret, digest_size=8, person=b"vllama-user").hexdigest()
