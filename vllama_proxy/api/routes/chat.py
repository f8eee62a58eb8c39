"""``POST /api/chat`` -> vLLM ``/v1/chat/completions``."""

from __future__ import annotations

from aiohttp import web

from ..fleet import affinity
from ..ollama.types import ChatRequest
from ..app_state import CATALOG, SETTINGS
from ..ollama.timestamps import Timings, now_ns
from ..ollama.to_ollama import ChatTranslator
from ..ollama.to_openai import chat_body, check_capabilities, final_only, with_model_defaults
from ..request.call import call_of
from .answer import answer
from .body import log_ignored
from .model_use import choose, load_reply


async def chat(request: web.Request) -> web.StreamResponse:
    """Ollama's chat: messages, tools, images, thinking; NDJSON stream by default.

    No messages only (pre)loads the model (``done_reason: load``/``unload``).
    """
    timings = Timings(now_ns())
    call = call_of(request)
    req: ChatRequest = call.typed  # the gate's parse (request/gate.py)
    use = await choose(request, call, req.model, load=bool(req.messages) or req.keep_alive != 0)  # an unload loads nothing
    if not req.messages:
        return await load_reply(request, call, use, req.keep_alive, chat=True)
    model = use.model
    caps = await request.app[CATALOG].capabilities(model)
    req, _ = with_model_defaults(req, use.made)
    check_capabilities(use.name, caps, tools=bool(req.tools), think=req.think, images=any(m.images for m in req.messages))
    whole = req.stream is False and final_only(model.vllm_args)  # vLLM reports the timings: ask it for one answer
    body, ignored = chat_body(req, use.served, whole=whole)  # to the base's name, or its LoRA adapter's
    log_ignored(ignored)
    settings = request.app[SETTINGS]
    key = affinity.chat_key(use.served, req.messages, settings.session_key, per_request=settings.request_sessions == "on")
    return await answer(request, call, use, "/v1/chat/completions", body, ChatTranslator, timings,
                        stream=req.stream is not False, whole=whole, keep_alive=req.keep_alive, session_key=key,
                        truncate=req.truncate is not False, shift=req.shift is not False)
