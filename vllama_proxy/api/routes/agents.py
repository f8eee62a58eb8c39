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

from vllama_proxy.errors import UpstreamError
from vllama_proxy.upstream import Upstream, encode_json

from .. import session
from ..admission import with_priority
from ..ollama_types import json_object
from ..app_keys import CATALOG, SETTINGS
from ..keys import key_of
from ..translate import (
    OUTPUT_TOKEN_FIELDS,
    cap_output_tokens,
    check_capabilities,
    upstream_model,
)
from ..request_body import read_body
from .model_use import resolve_model
from .openai import relay


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
    """
    data = json_object(await read_body(request))
    name, model, backend = await resolve_model(request, data.get("model"))
    catalog = request.app[CATALOG]
    if generates and _function_tools(data.get("tools")):
        check_capabilities(name, await catalog.capabilities(model), tools=True)
    data["model"] = upstream_model(catalog.created(name), model.name)
    if priority:
        with_priority(request, data)
    settings = request.app[SETTINGS]  # the conversation's key, so that a router keeps it on one engine
    headers = session.headers(settings.session_header, request.headers, session.agent_key(data["model"], data))

    async def ready() -> bytes:
        """The body as sent, built once the model is held: its context is known then (a model that was
        not running has no ``max_model_len`` before), and vLLM can count the prompt."""
        held = model if model.max_model_len else await catalog.resolve(name)
        if path == "/v1/messages":
            await fit_max_tokens(backend.upstream, data, held.max_model_len)
        if path in OUTPUT_TOKEN_FIELDS:  # the key's max_tokens, and the context (issue 38)
            cap_output_tokens(data, OUTPUT_TOKEN_FIELDS[path], held.max_model_len, key_of(request).max_tokens)
            _budget_below(data)
        return encode_json(data)

    return await relay(request, backend, path, b"", session_headers=headers, ready_body=ready)


def _budget_below(data: dict[str, Any]) -> None:
    """Anthropic's rule (and vLLM's check): ``thinking.budget_tokens`` stays below ``max_tokens``."""
    thinking, most = data.get("thinking"), data.get("max_tokens")
    if isinstance(thinking, dict) and isinstance(thinking.get("budget_tokens"), int) and isinstance(most, int) \
            and thinking["budget_tokens"] >= most:
        data["thinking"] = {**thinking, "budget_tokens": max(most - 1, 1)}


async def fit_max_tokens(upstream: Upstream, data: dict[str, Any], context: int | None) -> None:
    """Claude Code asks for more output than a local model's context holds (``max_tokens`` 32000,
    ``thinking.budget_tokens`` 31999: its CLAUDE_CODE_MAX_OUTPUT_TOKENS default), which vLLM
    refuses (0.26 and 0.32: ``max_completion_tokens=32000 cannot be greater than max_model_len``;
    0.26 also refuses a ``max_tokens`` that the prompt leaves no room for: "you requested 4096 output
    tokens and your prompt contains ...", seen on the H200) where Ollama generates until its context
    is full. So ``max_tokens`` is lowered to what ``context`` (the model's ``max_model_len``) leaves
    after the prompt, counted by vLLM's own ``/v1/messages/count_tokens`` (the same template and
    tools), or to ``context`` when vLLM cannot count; the thinking budget stays below it. A request
    that fits is sent as it is, with no extra call."""
    wanted = data.get("max_tokens")
    if not context or not isinstance(wanted, int) or isinstance(wanted, bool) or wanted < context:
        return
    room = context
    ask = {k: v for k, v in data.items() if k in ("model", "messages", "system", "tools", "tool_choice", "thinking")}
    try:
        used = (await upstream.post_json("/v1/messages/count_tokens", ask)).get("input_tokens")
    except (UpstreamError, AttributeError):
        used = None
    if isinstance(used, int) and not isinstance(used, bool):
        room = max(context - used, 1)
    data["max_tokens"] = min(wanted, room)
    _budget_below(data)


def _function_tools(tools: Any) -> bool:
    """Whether ``tools`` has a tool the model itself must call (a function; Anthropic's custom
    tools have no ``type`` or ``type: custom``), not only server-side tools vLLM runs or ignores."""
    if not isinstance(tools, list):
        return False
    return any(isinstance(t, dict) and t.get("type", "custom") in ("function", "custom") for t in tools)
