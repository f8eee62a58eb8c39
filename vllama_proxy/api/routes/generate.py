"""``POST /api/generate`` -> vLLM ``/v1/completions`` (raw) or ``/v1/chat/completions`` (templated)."""

from __future__ import annotations

from aiohttp import web

from vllama_proxy.errors import UnsupportedCapability
from ..fleet import affinity
from ..app_state import CATALOG
from ..ollama.types import GenerateRequest
from ..ollama.timestamps import Timings, now_ns
from ..ollama.to_ollama import GenerateTranslator
from ..ollama.to_openai import check_capabilities, fim_body, final_only, generate_body, with_model_defaults
from ..request.call import call_of
from .answer import answer
from .body import log_ignored
from .model_use import choose, load_reply


async def generate(request: web.Request) -> web.StreamResponse:
    """Ollama's generate: NDJSON stream by default, one JSON object with ``stream: false``.

    An empty prompt only (pre)loads the model (``done_reason: load``/``unload``).
    ``suffix`` (fill-in-the-middle, what code editors send) goes to ``/v1/completions`` as the
    model's FIM prompt (``models/fim.py``, ``to_openai.fim_body``); a model without a FIM format
    gets Ollama's 400 ``"X" does not support insert``. A non-empty ``context`` is refused (400).
    """
    timings = Timings(now_ns())
    call = call_of(request)
    req: GenerateRequest = call.typed  # the gate's parse (request/gate.py)
    generates = bool(req.prompt or req.images or req.suffix)
    use = await choose(request, call, req.model, load=generates or req.keep_alive != 0)  # an unload loads nothing
    if not generates:
        return await load_reply(request, call, use, req.keep_alive, chat=False)
    catalog = request.app[CATALOG]
    model = use.model
    caps = await catalog.capabilities(model)
    fmt = await catalog.fim(model) if req.suffix else None
    req, before = with_model_defaults(req, use.made)
    whole = req.stream is False and final_only(model.vllm_args)  # vLLM reports the timings: ask it for one answer
    if not req.suffix:
        check_capabilities(use.name, caps, think=None if req.raw else req.think, images=bool(req.images))
        path, body, ignored = generate_body(req, use.served, before, whole=whole)
    else:  # fill-in-the-middle: the model's own FIM prompt
        if fmt is None or "insert" not in caps:
            raise UnsupportedCapability(use.name, "insert")
        check_capabilities(use.name, caps)
        path = "/v1/completions"
        body, ignored = fim_body(req, use.served, fmt, whole=whole)
    log_ignored(ignored)
    key = affinity.generate_key(use.served, req.system)
    return await answer(request, call, use, path, body, GenerateTranslator, timings,
                        stream=req.stream is not False, whole=whole, keep_alive=req.keep_alive, session_key=key,
                        truncate=req.truncate is not False, shift=req.shift is not False)
