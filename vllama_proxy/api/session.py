"""A conversation's stable key, sent upstream so that a router keeps it on one engine.

Ollama clients resend the whole history every turn and name no session, so the key is made
from what stays the same across a conversation's turns: the model, the system messages and
the first user message (``/api/chat``; the system messages alone with ``--session-key system``),
or the model and ``system`` (``/api/generate``).
``vllm-router``'s ``consistent_hash`` policy reads it from the ``X-Session-ID`` header
(vllm-project/router, ``src/policies/consistent_hash.rs``: ``X-Session-ID``, then
``X-User-ID``, then the body's ``user``); other policies and a plain vLLM ignore the header.
A key the client sent itself (the same header) is kept as it is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from .ollama_types import Message

_JSON = {"Content-Type": "application/json"}


def chat_key(model: str, messages: Sequence[Message], scope: str = "conversation") -> str | None:
    """32 hex characters from ``model``, the system messages before the first user message and
    that message (text and images); ``None`` when there is no user message yet.

    ``scope="system"`` (``--session-key system``) leaves the user message out when there is a
    system message: every conversation that shares a system prompt gets one key, so a router's
    ``sticky_least_loaded`` policy keeps that shared prefix on one engine and spreads the
    distinct prompts over the engines (docs/fleet.md); without a system message it is the
    conversation's key (a key of the model alone would send every such chat to one engine).
    """
    if scope == "system":
        systems = [m for m in messages[:next((i for i, m in enumerate(messages) if m.role == "user"), 0)] if m.role == "system"]
        if systems and any(m.role == "user" for m in messages):
            h = hashlib.blake2b(model.encode() + b"\0system", digest_size=16)
            for m in systems:
                h.update(b"\0" + (m.content or "").encode())
            return h.hexdigest()
    h = hashlib.blake2b(model.encode(), digest_size=16)
    for m in messages:
        h.update(b"\0" + m.role.encode() + b"\0" + (m.content or "").encode())
        for image in m.images or ():
            h.update(b"\1" + image[:64].encode())
        if m.role == "user":
            return h.hexdigest()
    return None


def generate_key(model: str, system: str | None) -> str | None:
    """32 hex characters from ``model`` and ``system``; ``None`` without a system prompt (each
    ``/api/generate`` prompt is its own conversation: the router's policy decides alone)."""
    if not system:
        return None
    return hashlib.blake2b(model.encode() + b"\0" + system.encode(), digest_size=16).hexdigest()


def headers(header: str, client: Mapping[str, str], key: str | None) -> Mapping[str, str]:
    """The upstream request's headers: JSON, plus ``header: key`` (the client's own value first).

    ``header`` empty (``--session-header ''``) sends none.
    """
    if not header:
        return _JSON
    value = client.get(header) or key
    return {**_JSON, header: value} if value else _JSON
