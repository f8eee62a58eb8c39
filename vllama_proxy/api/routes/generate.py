"""``POST /api/generate`` -> vLLM ``/v1/completions`` (raw) or ``/v1/chat/completions`` (templated)."""

from __future__ import annotations

from aiohttp import web

from vllama_proxy.errors import UnsupportedCapability
from ..fleet import affinity
from ..app_state import CATALOG
from ..ollama.types import GenerateRequest
from ..ollama.timestamps import Timings, now_ns
from ..ollama.to_ollama import GenerateTranslator
from ..ollama.to_openai import check_capabilities, fim_body, generate_body, upstream_model, with_model_defaults
from .answer import answer
from .body import log_ignored, read_request
from .model_use import created_of, load_reply, resolve_model


async def generate(request: web.Request) -> web.StreamResponse:
    """Ollama's generate: NDJSON stream by default, one JSON object with ``stream: false``.

    An empty prompt only (pre)loads the model (``done_reason: load``/``unload``).
    ``suffix`` (fill-in-the-middle, what code editors send) goes to ``/v1/completions`` as the
    model's FIM prompt (``models/fim.py``, ``to_openai.fim_body``); a model without a FIM format
    gets Ollama's 400 ``"X" does not support insert``. A non-empty ``context`` is refused (400).
    """
    timings = Timings(now_ns())
    req = await read_request(request, GenerateRequest)
    if not req.prompt and not req.images and not req.suffix:
        return await load_reply(request, req.model, req.keep_alive, chat=False)
    name, model, backend = await resolve_model(request, req.model)
    catalog = request.app[CATALOG]
    made = created_of(request, name)
    req, before = with_model_defaults(req, made)
    served = upstream_model(made, model.name)
    caps = await catalog.capabilities(model)
    if req.suffix:
        fmt = await catalog.fim(model)
        if fmt is None or "insert" not in caps:
            raise UnsupportedCapability(name, "insert")
        check_capabilities(name, caps)
        path = "/v1/completions"
        body, ignored = fim_body(req, served, fmt)
    else:
        check_capabilities(name, caps, think=None if req.raw else req.think, images=bool(req.images))
        path, body, ignored = generate_body(req, served, before)
    log_ignored(ignored)
    key = affinity.generate_key(served, req.system)
    return await answer(request, name, model, backend, path, body, GenerateTranslator, timings,
                        stream=req.stream is not False, keep_alive=req.keep_alive, session_key=key, made=made,
                        truncate=req.truncate is not False, shift=req.shift is not False)
