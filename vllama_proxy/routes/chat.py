"""``POST /api/chat`` -> vLLM ``/v1/chat/completions``."""

from __future__ import annotations

from aiohttp import web

from ..ollama_types import ChatRequest
from ..state import CATALOG, UPSTREAM
from ..stream import ChatTranslator, Timings, relay
from ..translate import chat_body, check_capabilities
from .common import done_with_model, load_reply, log_ignored, now_ns, read_request, resolve_model, use_model


async def chat(request: web.Request) -> web.StreamResponse:
    """Ollama's chat: messages, tools, images, thinking; NDJSON stream by default.

    No messages only (pre)loads the model (``done_reason: load``/``unload``).
    """
    timings = Timings(now_ns())
    req = await read_request(request, ChatRequest)
    name, model = await resolve_model(request, req.model)
    if not req.messages:
        return await load_reply(request, name, req.keep_alive, chat=True)
    caps = await request.app[CATALOG].capabilities(model)
    images = any(m.images for m in req.messages)
    check_capabilities(name, caps, tools=bool(req.tools), think=req.think, images=images)
    body, ignored = chat_body(req, model.name)
    log_ignored(ignored)
    keep = await use_model(request, req.keep_alive)
    stream = req.stream is not False
    translator = ChatTranslator(name, timings, aggregate=not stream)
    try:
        return await relay(request, request.app[UPSTREAM], "/v1/chat/completions", body, translator, stream=stream)
    finally:
        done_with_model(request, keep)
