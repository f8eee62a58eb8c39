"""``POST /api/chat`` -> vLLM ``/v1/chat/completions``."""

from __future__ import annotations

from aiohttp import web

from ..fleet import affinity
from ..ollama.types import ChatRequest
from ..app_state import CATALOG, SETTINGS
from ..ollama.timestamps import Timings, now_ns
from ..ollama.to_ollama import ChatTranslator
from ..ollama.to_openai import chat_body, check_capabilities, upstream_model, with_model_defaults
from .answer import answer
from .body import log_ignored, read_request
from .model_use import created_of, load_reply, resolve_model


async def chat(request: web.Request) -> web.StreamResponse:
    """Ollama's chat: messages, tools, images, thinking; NDJSON stream by default.

    No messages only (pre)loads the model (``done_reason: load``/``unload``).
    """
    timings = Timings(now_ns())
    req = await read_request(request, ChatRequest)
    if not req.messages:
        return await load_reply(request, req.model, req.keep_alive, chat=True)
    name, model, backend = await resolve_model(request, req.model)
    made = created_of(request, name)
    req, _ = with_model_defaults(req, made)
    caps = await request.app[CATALOG].capabilities(model)
    images = any(m.images for m in req.messages)
    check_capabilities(name, caps, tools=bool(req.tools), think=req.think, images=images)
    served = upstream_model(made, model.name)  # the base's name, or its LoRA adapter's
    body, ignored = chat_body(req, served)
    log_ignored(ignored)
    settings = request.app[SETTINGS]
    key = affinity.chat_key(served, req.messages, settings.session_key, per_request=settings.request_sessions == "on")
    return await answer(request, name, model, backend, "/v1/chat/completions", body, ChatTranslator, timings,
                        stream=req.stream is not False, keep_alive=req.keep_alive, session_key=key, made=made,
                        truncate=req.truncate is not False, shift=req.shift is not False)
