"""The coding agents' APIs: Anthropic's ``/v1/messages`` (Claude Code) and OpenAI's ``/v1/responses`` (Codex).

Ollama serves both since 0.14 (``/v1/messages``, Claude Code) and 0.13.3 (``/v1/responses``,
stateless, Codex); vLLM 0.26+ has its own endpoints for both (``vllm/entrypoints/anthropic``,
``vllm/entrypoints/openai/responses``), which turn the request into a chat completion through the
model's chat template and parsers: a ``tool_use`` block from ``--tool-call-parser``, a ``thinking``
block from ``--reasoning-parser``. vllama relays to them byte for byte and adds what ``/api/chat``
has before a request goes upstream (``model_use.py``): the model named as Ollama names it (served
name, alias, library name, created model, on-demand local model), the key's role and model
allow-list, the on-demand slot, the keep-alive, the per-key usage (read from the answer's last
bytes, ``openai._usage``), the access log line, and the conversation's key for a router in front of
several engines (``session.agent_key``: Codex's ``prompt_cache_key``, Claude Code's session id). A request with tools for a model served
without a tool parser gets a clear 400 here (``"X" does not support tools``, in Anthropic's error
shape on ``/v1/messages``: ``api/app.py``) instead of vLLM's advice about its own flags.

Fair share: the admission bound and each key's share apply as on every route; the request's vLLM
``priority`` reaches ``/v1/responses`` (a field of vLLM's ``ResponsesRequest``), not
``/v1/messages`` (vLLM's ``AnthropicMessagesRequest`` has none, so it would be dropped).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from vllama_proxy.upstream import encode_json

from .. import session
from ..admission import with_priority
from ..api_keys import key_of
from ..cache_salt import own_caches
from ..ollama_types import json_object
from ..app_state import CATALOG, CLIENT_SESSIONS, SETTINGS
from ..translate.to_openai import (
    OUTPUT_TOKEN_FIELDS,
    check_capabilities,
    upstream_model,
)
from ..request_body import read_body
from .model_use import resolve_model
from .output_tokens import cap_output
from .openai import check_stops, relay


async def messages(request: web.Request) -> web.StreamResponse:
    """``POST /v1/messages`` (Anthropic Messages; Claude Code sends ``?beta=true``, relayed as sent)."""
    return await _relay(request, "/v1/messages", priority=False)


async def count_tokens(request: web.Request) -> web.StreamResponse:
    """``POST /v1/messages/count_tokens``: vLLM renders the prompt and counts it; nothing is generated."""
    return await _relay(request, "/v1/messages/count_tokens", priority=False, generates=False)


async def responses(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses`` (OpenAI Responses, as Codex sends it: ``store: false``, stateless)."""
    return await _relay(request, "/v1/responses", priority=True)


async def _relay(request: web.Request, path: str, *, priority: bool, generates: bool = True) -> web.StreamResponse:
    """Resolve, check and relay one agent request to ``path`` of the model's vLLM.

    Raises:
        BadRequest: the body is not a JSON object, or names no model.
        ModelNotFound: the model is unknown (404).
        Forbidden: the key may not use the model (403).
        UnsupportedCapability: ``tools`` for a model served without a tool parser (400).
        BadRequest: more ``stop_sequences`` than ``ollama_types.MAX_STOPS`` (``openai.check_stops``), or a
            ``cache_salt`` vLLM would refuse (``cache_salt.own_caches``).
    """
    data = json_object(await read_body(request))
    check_stops(data, ("stop_sequences",))  # before the model is claimed: vLLM checks each on every token
    if generates:  # the key's own share of the prefix cache and the media caches (count_tokens uses none)
        own_caches(data, key_of(request).cache_salt)
    name, model, backend = await resolve_model(request, data.get("model"))
    catalog = request.app[CATALOG]
    if generates and _function_tools(data.get("tools")):
        check_capabilities(name, await catalog.capabilities(model), tools=True)
    data["model"] = upstream_model(catalog.created(name), model.name)
    if priority:
        with_priority(request, data)
    settings = request.app[SETTINGS]  # the conversation's key, so that a router keeps it on one engine
    clients = request.app[CLIENT_SESSIONS]

    async def ready() -> bytes:
        """The body as sent, built once the model is held: its context is known then (a model that was
        not running has no ``max_model_len`` before), and vLLM can count the prompt."""
        held = model if model.max_model_len else await catalog.resolve(name)
        if path in OUTPUT_TOKEN_FIELDS:  # the key's max_tokens, and what the context leaves the answer (issue 38)
            await cap_output(request, backend.upstream, held, data, OUTPUT_TOKEN_FIELDS[path])
            _budget_below(data)
        return encode_json(data)

    with clients.hold_request(request) as own:  # the client's own key, scoped, counted until the end
        headers = session.headers(settings.session_header, own, session.agent_key(data["model"], data))
        return await relay(request, backend, path, b"", session_headers=headers, ready_body=ready)


def _budget_below(data: dict[str, Any]) -> None:
    """Anthropic's rule (and vLLM's check): ``thinking.budget_tokens`` stays below ``max_tokens``."""
    thinking, most = data.get("thinking"), data.get("max_tokens")
    if isinstance(thinking, dict) and isinstance(thinking.get("budget_tokens"), int) and isinstance(most, int) \
            and thinking["budget_tokens"] >= most:
        data["thinking"] = {**thinking, "budget_tokens": max(most - 1, 1)}


def _function_tools(tools: Any) -> bool:
    """Whether ``tools`` has a tool the model itself must call (a function; Anthropic's custom
    tools have no ``type`` or ``type: custom``), not only server-side tools vLLM runs or ignores."""
    if not isinstance(tools, list):
        return False
    return any(isinstance(t, dict) and t.get("type", "custom") in ("function", "custom") for t in tools)
