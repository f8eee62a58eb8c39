"""``POST /api/chat`` -> vLLM ``/v1/chat/completions``."""

from __future__ import annotations

from aiohttp import web

from .. import session
from ..ollama_types import ChatRequest
from ..app_keys import CATALOG, SETTINGS
from ..stream import ChatTranslator, Timings, relay
from ..translate import chat_body, check_capabilities, final_only, unstreamed, upstream_model, with_model_defaults
from .body import log_ignored, read_request
from .output_tokens import cap_output
from .model_use import created_of, load_reply, lookup_model, model_in_use, resolve_model, wants_unload
from ..admission import with_priority
from ..timestamps import now_ns


async def chat(request: web.Request) -> web.StreamResponse:
    """Ollama's chat: messages, tools, images, thinking; NDJSON stream by default.

    No messages only (pre)loads the model (``done_reason: load``/``unload``).
    """
    timings = Timings(now_ns())
    req = await read_request(request, ChatRequest)
    if (not req.messages) and wants_unload(request, req.keep_alive):
        name, _, maybe = await lookup_model(request, req.model)  # an unload never loads the model first
        return await load_reply(request, name, maybe, req.keep_alive, chat=True)
    name, model, backend = await resolve_model(request, req.model)
    if not req.messages:
        return await load_reply(request, name, backend, req.keep_alive, chat=True)
    made = created_of(request, name)
    req, _ = with_model_defaults(req, made)
    caps = await request.app[CATALOG].capabilities(model)
    images = any(m.images for m in req.messages)
    check_capabilities(name, caps, tools=bool(req.tools), think=req.think, images=images)
    served = upstream_model(made, model.name)  # the base's name, or its LoRA adapter's
    body, ignored = chat_body(req, served)
    log_ignored(ignored)
    stream = req.stream is not False
    whole = not stream and final_only(model.vllm_args)  # vLLM reports the timings: ask it for one answer
    if whole:
        unstreamed(body)
    translator = ChatTranslator(name, timings, aggregate=not stream)
    # the conversation's key, so that a router in front of several engines keeps it on one (api/session.py)
    headers = session.headers(request.app[SETTINGS].session_header, request.headers, session.chat_key(served, req.messages, request.app[SETTINGS].session_key))
    async with model_in_use(request, backend, req.keep_alive):
        await cap_output(request, backend.upstream, model, body, ("max_tokens",))  # num_predict within the context and the key's cap
        return await relay(request, backend.upstream, "/v1/chat/completions", with_priority(request, body), translator, stream=stream,
                           headers=headers, final_only=whole)
