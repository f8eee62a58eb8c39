"""The tail ``/api/chat`` and ``/api/generate`` share: their vLLM body, once built, answered.

The handlers parse, resolve the model and build the body (``ollama/to_openai.py``); from there
the two are the same: a non-streamed request to a vLLM that reports per-request timings asks it
for one unstreamed answer, the conversation's key goes upstream for a router, the model is held
for the request, the body is finished (``finisher.py``), and the answer is relayed back through the
route's translator (``relay.py``, ``ollama/to_ollama.py``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from vllama_proxy.errors import UpstreamRejected
from vllama_proxy.logs import get_logger
from vllama_proxy.models.created import CreatedModel
from vllama_proxy.models.vllm_servers import Backend, ServedModel
from vllama_proxy.upstream import Upstream
from ..fleet import affinity
from ..app_state import CLIENT_AFFINITY, ROUTER_RELEASE, SETTINGS, WORKER
from ..request.call import call_of
from ..request.context_fit import fit, is_context_full, refusal
from ..policy.fair_queue import prompt_tokens_guess
from ..request.finisher import finish
from ..request.relay import relay
from ..request.resume import Resume, resume_timeout
from ..ollama.timestamps import Timings
from ..ollama.to_ollama import Translator
from ..ollama.to_openai import final_only, unstreamed
from .model_use import model_in_use

log = get_logger("vllama.routes")


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


async def answer(request: web.Request, name: str, model: ServedModel, backend: Backend, path: str, body: dict[str, Any],
                 translator: type[Translator], timings: Timings, *, stream: bool, keep_alive: Any,
                 session_key: str | None, made: CreatedModel | None = None, truncate: bool = True,
                 shift: bool = True) -> web.StreamResponse:
    """Send ``body`` to the model's vLLM at ``path`` (``/v1/chat/completions`` or ``/v1/completions``)
    and answer in Ollama's format: NDJSON when ``stream``, else one JSON object.

    Args:
        name: the model's name as the client sent it (echoed in every chunk).
        model, backend: the resolved model and its vLLM server (``model_use.resolve_model``).
        body: vLLM's request body as translated, completed by the finisher (``finisher.py``: the model's
            adapter, ``priority``, the key's ``cache_salt``, the output capped) once the model is held, and
            asked unstreamed (``to_openai.unstreamed``) when vLLM reports timings (``to_openai.final_only``).
        translator: the route's ``to_ollama`` translator class, built with ``timings``.
        keep_alive: the request's ``keep_alive`` (``model_use.model_in_use``).
        session_key: the conversation's key for a router in front of several engines
            (``api/fleet/affinity.py``), sent unless the client sent its own (before a router scoped to
            its caller and bounded in flight: ``api/fleet/client_affinity.py``); ``None`` with
            ``--request-sessions on``: a one-request key, released at the router when the
            answer ends, however it ends (``api/fleet/router_release.py``).
        made: the created model the client named (``None``: a served model).
        truncate, shift: Ollama's: a request vLLM refuses for its context is made to fit (``context_fit.py``:
            its oldest turns dropped, its output lowered to the room left) and sent again; false: refused.

    Raises what ``model_in_use``, ``finish`` and ``relay`` raise before the first byte
    (the model cannot be loaded, the context is full, vLLM refused the request). A client that leaves
    mid-answer is charged the chunks it was sent (the translator's count: vLLM sends one a token) and
    its prompt by the body's size, unless vLLM's usage came first.
    """
    whole = not stream and final_only(model.vllm_args)  # vLLM reports the timings: ask it for one answer
    if whole:
        unstreamed(body)
    out = translator(name, timings, aggregate=not stream)
    settings = request.app[SETTINGS]
    call = call_of(request)
    with request.app[CLIENT_AFFINITY].hold_request(request) as own:  # counted until the answer ends
        sent, release = affinity.placement(settings.session_header, own, session_key, settings.request_sessions == "on")
        headers = {**affinity.JSON, **sent}
        async with model_in_use(request, backend, keep_alive):
            if path == "/v1/completions" and "max_tokens" not in body:
                body["max_tokens"] = await remaining_context(backend.upstream, model, body["prompt"])
            await finish(request, call, body, path, served=model.name, model=model, upstream=backend.upstream, made=made,
                         token_ids=settings.resume and not whole)
            resume = None
            if settings.resume and not whole:
                seconds, _ = resume_timeout(settings.resume_timeout, backend.board)
                resume = Resume(path, body, backend.upstream, backend.board, request.app[WORKER], seconds,
                                model.max_model_len, headers, request.path)
            try:
                try:
                    return await relay(request, backend.upstream, path, body, out, stream=stream, headers=headers,
                                       final_only=whole, resume=resume)
                except UpstreamRejected as e:  # over the context: made to fit once, as Ollama's truncate and shift do
                    if not is_context_full(e) or not model.max_model_len:
                        raise
                    before = len(body.get("messages") or ())
                    if await fit(backend.upstream, body, model.max_model_len, truncate=truncate, shift=shift) is None:
                        raise refusal(e) from None
                    log.info("context_fit", messages_before=before, messages_after=len(body.get("messages") or ()),
                             max_tokens=body.get("max_tokens"), truncate_prompt_tokens=body.get("truncate_prompt_tokens"))
                    return await relay(request, backend.upstream, path, body, out, stream=stream, headers=headers,
                                       final_only=whole, resume=resume)
            except (ConnectionError, asyncio.CancelledError):  # the client left mid-answer: vLLM's tokens so far were made
                if call.usage is None and out.output_tokens:
                    call.usage = (out.prompt_eval_count or int(prompt_tokens_guess(call.body)), out.output_tokens)
                raise
            finally:
                if release is not None:  # after the answer's last byte, or its error, or the client's leaving
                    request.app[ROUTER_RELEASE].release(backend.upstream, release)
