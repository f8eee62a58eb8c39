"""The coding agents' APIs: Anthropic's ``/v1/messages`` (Claude Code) and OpenAI's ``/v1/responses`` (Codex).

As Ollama 0.14 / 0.13.3 serve them; vLLM 0.26+ has its own endpoints for both
(``vllm/entrypoints/anthropic``, ``vllm/entrypoints/openai/responses``), rendering through the
model's chat template and parsers. The body is checked by the gate (``request/gate.py``), completed by
the finisher and relayed; around it, what ``/api/chat`` has (``model_use.py``): the model named as
Ollama names it, the key's role and models, the on-demand slot, keep-alive, per-key usage (from the
answer's last bytes, charged by ``settler.py``), the access log, and the conversation's router key
(``affinity.agent_key``). Tools for a model without a tool parser are a 400 here (``"X" does not
support tools``, in the route's error shape), not vLLM's advice about its flags. A key's vLLM
``priority`` reaches ``/v1/responses`` only (vLLM's ``AnthropicMessagesRequest`` has no such field).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from vllama_proxy.upstream import encode_json

from ..fleet import affinity
from ..request.call import call_of
from ..request.finisher import finish
from ..request.gate import upstream_fields
from ..ollama.types import json_object
from ..app_state import CATALOG, CLIENT_AFFINITY, SETTINGS
from ..ollama.to_openai import check_capabilities
from .model_use import choose
from .openai import _rename, forward


async def messages(request: web.Request) -> web.StreamResponse:
    """``POST /v1/messages`` (Anthropic Messages; Claude Code sends ``?beta=true``, relayed as sent)."""
    return await _forward(request, "/v1/messages")


async def count_tokens(request: web.Request) -> web.StreamResponse:
    """``POST /v1/messages/count_tokens``: vLLM renders the prompt and counts it; nothing is generated (its
    prompt tokens are charged, as a prompt: ``openai._usage``)."""
    return await _forward(request, "/v1/messages/count_tokens", generates=False)


async def responses(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses`` (OpenAI Responses, as Codex sends it: ``store: false``, stateless)."""
    return await _forward(request, "/v1/responses")


async def _forward(request: web.Request, path: str, *, generates: bool = True) -> web.StreamResponse:
    """Resolve, check and relay one agent request (typed and checked by the gate, ``request/gate.py``) to ``path``
    of the model's vLLM, its body finished by ``finisher.py``.

    Raises:
        BadRequest: the body is not a JSON object, or names no model.
        ModelNotFound: the model is unknown (404).
        Forbidden: the key may not use the model (403).
        UnsupportedCapability: ``tools`` for a model served without a tool parser (400).
    """
    call = call_of(request)
    data = upstream_fields(call)
    if not isinstance(data, dict):  # not through the gate (admission runs it for every POST under /v1/)
        data = json_object(call.body or b"")
        call.asked = data.get("model") if isinstance(data.get("model"), str) else None
    use = await choose(request, call, call.asked)
    name, model, backend, made = use.name, use.model, use.backend, use.made
    assert backend is not None
    catalog = request.app[CATALOG]
    if generates and _function_tools(data.get("tools")):
        check_capabilities(name, await catalog.capabilities(model), tools=True)
    data["model"] = use.served
    settings = request.app[SETTINGS]  # the conversation's key, so that a router keeps it on one engine
    clients = request.app[CLIENT_AFFINITY]

    async def ready() -> bytes:
        """The body as sent, built once the model is held: its context is known then (a model that was
        not running has no ``max_model_len`` before), and vLLM can count the prompt."""
        held = model if model.max_model_len else await catalog.resolve(name, made=made)
        await finish(call, data, path, served=held.name, model=held, upstream=backend.upstream, made=made, relayed=True)
        return encode_json(data)

    with clients.hold_request(request) as own:  # the client's own key, scoped, counted until the end
        headers = affinity.headers(settings.session_header, own, affinity.agent_key(data["model"], data))
        return await forward(request, backend, path, b"", session_headers=headers, ready_body=ready,
                           rename=_rename(made, model, name))


def _function_tools(tools: Any) -> bool:
    """Whether ``tools`` has a tool the model itself must call (a function; Anthropic's custom
    tools have no ``type`` or ``type: custom``), not only server-side tools vLLM runs or ignores."""
    if not isinstance(tools, list):
        return False
    return any(isinstance(t, dict) and t.get("type", "custom") in ("function", "custom") for t in tools)
