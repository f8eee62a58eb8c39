"""``POST /api/generate`` -> vLLM ``/v1/completions`` (raw) or ``/v1/chat/completions`` (templated)."""

from __future__ import annotations

from aiohttp import web

from ..errors import UnsupportedCapability
from ..ollama_types import GenerateRequest
from ..state import CATALOG, UPSTREAM
from ..stream import GenerateTranslator, Timings, relay
from ..translate import check_capabilities, generate_body
from .common import load_reply, log_ignored, now_ns, read_request, resolve_model


async def generate(request: web.Request) -> web.StreamResponse:
    """Ollama's generate: NDJSON stream by default, one JSON object with ``stream: false``.

    An empty prompt only (pre)loads the model (``done_reason: load``/``unload``).
    ``suffix`` needs fill-in-the-middle, which vLLM's completions endpoint lacks:
    answered as Ollama does for a model without it, 400 ``"X" does not support insert``.
    """
    timings = Timings(now_ns())
    req = await read_request(request, GenerateRequest)
    name, model = await resolve_model(request, req.model)
    if not req.prompt and not req.images and not req.suffix:
        return load_reply(name, req.keep_alive, chat=False)
    caps = await request.app[CATALOG].capabilities(model)
    if req.suffix:
        raise UnsupportedCapability(name, "insert")
    check_capabilities(name, caps, think=None if req.raw else req.think, images=bool(req.images))
    path, body, ignored = generate_body(req, model.name)
    log_ignored(ignored)
    stream = req.stream is not False
    translator = GenerateTranslator(name, timings, aggregate=not stream)
    return await relay(request, request.app[UPSTREAM], path, body, translator, stream=stream)
