"""A conversation's stable key, sent upstream so that a router keeps it on one engine.

Ollama clients resend the whole history every turn and name no session, so the key is made from what
stays the same across turns: the model, the system messages and the first user message
(``/api/chat``; the system messages alone with ``--session-key system``), the model and ``system``
(``/api/generate``), or the agent's own conversation id (:func:`agent_key`). vllm-router's
``consistent_hash`` reads it from ``X-Session-ID`` (then ``X-User-ID``, then the body's ``user``:
``src/policies/consistent_hash.rs``). A client's own key is scoped, hashed and bounded
(:func:`client_key`, ``client_affinity.py``). With ``--request-sessions`` a request with nothing to
share gets a key of its own (:func:`placement`), released at its end (``router_release.py``), so
``sticky_least_loaded`` sends distinct prompts to the least loaded engine.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable, Mapping, Sequence

import orjson

from ..ollama.types import Message

JSON = {"Content-Type": "application/json"}


def chat_key(model: str, messages: Sequence[Message], scope: str = "conversation", per_request: bool = False) -> str | None:
    """32 hex characters from ``model``, the system messages before the first user message and
    that message (text and images); ``None`` when there is no user message yet.

    ``scope="system"`` (``--session-key system``) leaves the user message out when there is a
    system message: every conversation that shares a system prompt gets one key, so a router's
    ``sticky_least_loaded`` policy keeps that shared prefix on one engine and spreads the
    distinct prompts over the engines (docs/fleet.md); without a system message it is the
    conversation's key (a key of the model alone would send every such chat to one engine), or
    ``None`` with ``per_request`` (``--request-sessions on``: each turn is then placed by load
    under a one-request key, :func:`placement`).
    """
    return _turns_key(model, ((m.role, m.content or "", m.images or ()) for m in messages), scope, per_request, ("system",))


def _turns_key(model: str, turns: Iterable[tuple[str, str, Sequence[str]]], scope: str, per_request: bool,
               system_roles: tuple[str, ...]) -> str | None:
    """The key of a chat given as ``(role, text, images)`` turns, for :func:`chat_key` (Ollama's
    messages) and :func:`openai_key` (OpenAI's) alike, so that both APIs' chats get one key: under
    ``scope="system"`` the shared-prefix key of the ``system_roles`` turns before the first user
    turn, if any; else (or without one and not ``per_request``) the conversation's, a hash of every
    turn up to and including the first user turn (an image by its first 64 characters). ``None``
    without a user turn, or without a system turn under ``scope="system"`` with ``per_request``."""
    systems: list[str] = []
    h = hashlib.blake2b(model.encode(), digest_size=16)
    for role, text, images in turns:
        h.update(b"\0" + role.encode() + b"\0" + text.encode())
        for image in images:
            h.update(b"\1" + image[:64].encode())
        if role == "user":
            if scope == "system" and systems:
                return _system_key(model, systems)
            if scope == "system" and per_request:
                return None
            return h.hexdigest()
        if role in system_roles:
            systems.append(text)
    return None


def agent_key(model: str, body: Mapping[str, object]) -> str | None:
    """32 hex characters for an agent's conversation (``/v1/messages``, ``/v1/responses``): the id the
    agent gives it (Codex's ``prompt_cache_key``, its thread id; Claude Code's ``metadata.user_id``,
    which ends with its session id), else the system prompt (``system``/``instructions``) and the
    first user message, as :func:`chat_key` does; ``None`` when there is neither."""
    h = hashlib.blake2b(model.encode(), digest_size=16)
    metadata = body.get("metadata")
    given = body.get("prompt_cache_key") or (metadata.get("user_id") if isinstance(metadata, Mapping) else None)
    if isinstance(given, str) and given:
        h.update(b"\0id\0" + given.encode())
        return h.hexdigest()
    turns = body.get("messages") if "messages" in body else body.get("input")
    first = next((m for m in turns if isinstance(m, Mapping) and m.get("role") == "user"), None) if isinstance(turns, list) else None
    if first is None:
        return None
    system = body.get("system") or body.get("instructions") or ""
    h.update(b"\0" + orjson.dumps(system) + b"\0" + orjson.dumps(first.get("content"), option=orjson.OPT_SORT_KEYS))
    return h.hexdigest()


def generate_key(model: str, system: str | None) -> str | None:
    """32 hex characters from ``model`` and ``system``; ``None`` without a system prompt (each
    ``/api/generate`` prompt is its own conversation: the router's policy decides alone)."""
    if not system:
        return None
    return hashlib.blake2b(model.encode() + b"\0" + system.encode(), digest_size=16).hexdigest()


def _system_key(model: str, systems: Sequence[str]) -> str:
    h = hashlib.blake2b(model.encode() + b"\0system", digest_size=16)
    for text in systems:
        h.update(b"\0" + text.encode())
    return h.hexdigest()


def openai_key(model: str, body: Mapping[str, object], scope: str) -> str | None:
    """The key of a relayed ``/v1/chat/completions`` body, the one :func:`chat_key` gives ``/api/chat``
    for the same model and messages (their text parts), so both APIs' chats are placed alike.

    ``scope="system"``: the shared-prefix key of the system (and ``developer``) messages before the
    first user message; ``None`` without one (``--request-sessions on`` then sends a one-request key).
    ``scope="conversation"``: the conversation's key, from every message up to and including the
    first user message (an image part by its URL's first 64 characters), so each turn of a
    ``/v1`` conversation keeps its engine as an ``/api/chat`` one does (docs/fleet.md). ``None``
    without a user message, or without ``messages`` (``/v1/completions``).
    """
    turns = body.get("messages")
    if not isinstance(turns, list):
        return None
    parts = ((m.get("role") if isinstance(m.get("role"), str) else "", *_content_parts(m.get("content")))
             for m in turns if isinstance(m, Mapping))
    return _turns_key(model, parts, scope, True, ("system", "developer"))


def _content_parts(content: object) -> tuple[str, list[str]]:
    """An OpenAI message's ``content``: ``(its text, its image URLs)``; a string is all text."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        return "", []
    parts = [p for p in content if isinstance(p, Mapping)]
    text = "".join(p["text"] for p in parts if isinstance(p.get("text"), str))
    urls = [u["url"] for p in parts if isinstance(u := p.get("image_url"), Mapping) and isinstance(u.get("url"), str)]
    return text, urls


def one_request_key() -> str:
    """A fresh session key for one request (``r`` and 32 hex characters), never sent twice."""
    return "r" + secrets.token_hex(16)


def client_key(caller: str, value: str) -> str:
    """32 hex characters for a client's own session value (``X-Session-ID``) sent by ``caller`` (the API
    key's name): the same pair always gets the same key, another caller the same value another key.
    BLAKE2b under its own personalisation, so it is no key vllama makes (whatever a client puts in a
    system prompt or a header) and the router never sees the client's string (``api/fleet/client_affinity.py``)."""
    return hashlib.blake2b(caller.encode() + b"\0" + value.encode("utf-8", "surrogateescape"), digest_size=16,
                           person=b"vllama-client").hexdigest()


def placement(header: str, own: str | None, key: str | None, per_request: bool) -> tuple[dict[str, str], str | None]:
    """``(the session header to send, the key to release when the request ends)``.

    ``own``, the client's key (``api/fleet/client_affinity.py``'s ``ClientAffinity.hold``: its value scoped to its caller,
    ``None`` beyond the bound in flight), is sent and never released; else ``key``; a request with no
    ``key``, with ``per_request`` (``--request-sessions on``), gets :func:`one_request_key`, which is
    returned to be released at the router (``api/fleet/router_release.py``). ``header`` empty
    (``--session-header ''``) sends nothing.
    """
    if not header:
        return {}, None
    if own:
        return {header: own}, None
    if key is None and per_request:
        key = one_request_key()
        return {header: key}, key
    return ({header: key} if key else {}), None


def headers(header: str, own: str | None, key: str | None) -> Mapping[str, str]:
    """The upstream request's headers: JSON, plus ``header: key`` (the client's key ``own`` first).

    ``header`` empty (``--session-header ''``) sends none.
    """
    return {**JSON, **placement(header, own, key, False)[0]}
