"""``POST /api/generate`` -> vLLM ``/v1/completions`` (raw) or ``/v1/chat/completions`` (templated)."""

from __future__ import annotations

from aiohttp import web

from vllama_proxy.errors import UnsupportedCapability, UpstreamRejected
from vllama_proxy.models.backends import ServedModel
from vllama_proxy.upstream import Upstream
from .body import log_ignored, read_request
from .output_tokens import cap_output
from .model_use import created_of, load_reply, lookup_model, model_in_use, resolve_model, wants_unload
from ..admission import with_priority
from ..timestamps import now_ns
from .. import session
from ..ollama_types import GenerateRequest
from ..app_keys import CATALOG, SETTINGS
from ..stream import GenerateTranslator, Timings, relay
from ..translate import check_capabilities, fim_body, final_only, generate_body, unstreamed, upstream_model, with_model_defaults


async def remaining_context(upstream: Upstream, model: ServedModel, prompt: str) -> int:
    """``max_tokens`` meaning "until the context is full": context length minus prompt tokens.

    vLLM's ``/v1/completions`` stops at 16 tokens when ``max_tokens`` is absent or null
    (measured on vLLM 0.26, ``benchmarks/RESULTS.md``), unlike Ollama's ``num_predict: -1``.
    The prompt is counted by vLLM's own ``/tokenize``; if that fails, by its UTF-8 length
    (an upper bound for byte-level tokenizers), so the cap stays within the context.
    """
    try:
        data = await upstream.post_json("/tokenize", {"model": model.name, "prompt": prompt})
        count = int(data["count"])
        limit = int(data.get("max_model_len") or model.max_model_len or 0)
    except (UpstreamRejected, KeyError, TypeError, ValueError):
        count = len(prompt.encode()) + 2
        limit = model.max_model_len or 0
    return max(limit - count, 1)


async def generate(request: web.Request) -> web.StreamResponse:
    """Ollama's generate: NDJSON stream by default, one JSON object with ``stream: false``.

    An empty prompt only (pre)loads the model (``done_reason: load``/``unload``).
    ``suffix`` (fill-in-the-middle, what code editors send) goes to ``/v1/completions`` as the
    model's FIM prompt (``models/fim.py``, ``translate.fim_body``); a model without a FIM format
    gets Ollama's 400 ``"X" does not support insert``. A non-empty ``context`` is refused (400).
    """
    timings = Timings(now_ns())
    req = await read_request(request, GenerateRequest)
    if (not req.prompt and not req.images and not req.suffix) and wants_unload(request, req.keep_alive):
        name, _, maybe = await lookup_model(request, req.model)  # an unload never loads the model first
        return await load_reply(request, name, maybe, req.keep_alive, chat=False)
    name, model, backend = await resolve_model(request, req.model)
    if not req.prompt and not req.images and not req.suffix:
        return await load_reply(request, name, backend, req.keep_alive, chat=False)
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
    stream = req.stream is not False
    whole = not stream and final_only(model.vllm_args)  # vLLM reports the timings: ask it for one answer
    if whole:
        unstreamed(body)
    translator = GenerateTranslator(name, timings, aggregate=not stream)
    async with model_in_use(request, backend, req.keep_alive):
        if path == "/v1/completions" and "max_tokens" not in body:
            body["max_tokens"] = await remaining_context(backend.upstream, model, body["prompt"])
        headers = session.headers(request.app[SETTINGS].session_header, request.headers, session.generate_key(served, req.system))
        await cap_output(request, backend.upstream, model, body, ("max_tokens",))  # num_predict within the context and the key's cap
        return await relay(request, backend.upstream, path, with_priority(request, body), translator, stream=stream, headers=headers,
                           final_only=whole)
