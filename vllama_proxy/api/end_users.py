"""End users as sub-tenants of a key: the people behind a trusted front end (Open WebUI) that uses one key.

A key the operator marks ``trusted_front = true`` in the keys file (``api_keys.py``) names the end user of
each request; the gate reads it once (:func:`end_user`, into ``Call.end_user``), from, in order:

- the key's ``user_header`` (default ``X-OpenWebUI-User-Id``: Open WebUI sends it with
  ``ENABLE_FORWARD_USER_INFO_HEADERS=true``), on every route (the Ollama routes have no other place);
- with ``user_body`` (default on), the body: OpenAI's ``user``, then ``safety_identifier`` (``/v1/chat/completions``,
  ``/v1/completions``, ``/v1/responses``, ``/v1/embeddings``), Anthropic's ``metadata.user_id`` (``/v1/messages``);
- none: :data:`ANONYMOUS`, one user of that key.

What it then is:

- a place in the fair queue under its key (``fair_queue.py``: the user's own counter at :func:`slot_of`, the
  key's weight split evenly between its active users, so one user's flood does not stall another's request and the
  key as a whole keeps its share against other keys);
- the key's per-user limits (``user_max_in_flight``, ``user_rpm``, ``user_tpm``, ``user_budget_tokens``: ``admission.py``),
  refused with the statuses and shapes of the key's own, naming the user-level limit;
- the ledger's ``end_user`` column (``ledger_store.py``: ``vllama usage --by user``, ``/api/usage?user=``);
- ``end_user`` in the access log, or with the key's ``hash_end_users`` its :func:`log_name`.

Any other key cannot name other users: its header and body fields are ignored for tenancy (the request is the key's
own, ``end_user`` unset), never refused, since OpenAI clients send ``user`` routinely and a refusal would break
them for nothing; the ``user`` field still goes to vLLM as it did. Ignoring cannot widen what the key gets: its
limits and share stay the key's. The prefix-cache salt stays per key (``cache_salt.py``): the users of one front
share its system prompts, and splitting the cache between them would make every user pay its prefill.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any

from aiohttp import web

from vllama_proxy.errors import BadRequest
from .api_keys import KEY_SLOTS, Key

#: The end user of a trusted front's request that names none.
ANONYMOUS = "(anonymous)"
#: Counters for end users in the fair queue and the per-user limits, after the keys' :data:`~.api_keys.KEY_SLOTS`
#: (two users hashed to one counter share their limits and their share: they only hold tighter).
USER_SLOTS = 4096
#: The longest end-user id taken (Open WebUI's are UUIDs; an e-mail address fits).
MAX_LENGTH = 256


def end_user(request: web.Request, key: Key, typed: Any) -> str | None:
    """The end user a request of ``key`` is made for (see the module docstring): ``None`` for a key that is not a
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


def slot_of(key: Key, user: str) -> int:
    """The end user's counter (fair queue, per-user limits): ``KEY_SLOTS + CRC-32(key name, user) % USER_SLOTS``."""
    return KEY_SLOTS + zlib.crc32(f"{key.name}\0{user}".encode()) % USER_SLOTS


def log_name(key: Key, user: str | None) -> str | None:
    """What the access log shows of ``user``: as given, or with the key's ``hash_end_users`` 16 hex characters of
    BLAKE2b keyed with a secret of the key's (``Key.user_hash_key``: BLAKE2b of its name keyed with the SHA-256 of
    its secret, as ``cache_salt.of_key``), personalisation ``vllama-user``: the same user is the same name in every
    line, and nobody without the key's secret can tell which id it was."""
    if user is None or not key.hash_end_users:
        return user
    secret = key.user_hash_key or key.name.encode()[:64]
    return hashlib.blake2b(user.encode(), key=secret, digest_size=8, person=b"vllama-user").hexdigest()
