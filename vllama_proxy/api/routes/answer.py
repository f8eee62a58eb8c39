"""The tail ``/api/chat`` and ``/api/generate`` share: their vLLM body, once built, answered.

The handlers resolve the model (``model_use.choose``) and build the body (``ollama/to_openai.py``, asked
unstreamed when vLLM reports the timings); from there the two are the same: the conversation's key goes
upstream for a router, the model is held for the request, the body is finished (``finisher.py``), and the
answer is relayed back through the route's translator (``relay.py``, ``ollama/to_ollama.py``); a request
vLLM refuses for its context is made to fit once (``context_fit.py``) and sent again.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from vllama_proxy.errors import UpstreamRejected
from vllama_proxy.logs import get_logger
from ..fleet import affinity
from ..app_state import CLIENT_AFFINITY, ROUTER_RELEASE, SETTINGS, WORKER
from ..request.call import Call
from ..request.context_fit import fit, is_context_full, refusal
from ..policy.fair_queue import prompt_tokens_guess
from ..request.finisher import finish
from ..request.relay import relay
from ..request.resume import Resume, resume_timeout
from ..ollama.timestamps import Timings
from ..ollama.to_ollama import Translator
from .model_use import Resolved, model_in_use

log = get_logger("vllama.routes")


async def answer(request: web.Request, call: Call, use: Resolved, path: str, body: dict[str, Any],
                 translator: type[Translator], timings: Timings, *, stream: bool, whole: bool, keep_alive: float | None,
                 session_key: str | None, truncate: bool = True, shift: bool = True) -> web.StreamResponse:
    """Send ``body`` to the model's vLLM at ``path`` (``/v1/chat/completions`` or ``/v1/completions``)
    and answer in Ollama's format: NDJSON when ``stream``, else one JSON object.

    Args:
        call: the request's record (``request/call.py``): its key, and what the settler charges.
        use: the model as the route resolved it (``model_use.choose``, loading: it has a backend).
        body: vLLM's request body as translated (``ollama/to_openai.py``), completed by the finisher
            (``finisher.py``: the model's adapter, ``priority``, the key's ``cache_salt``, the output capped)
            once the model is held.
        translator: the route's ``to_ollama`` translator class, built with ``timings``.
        whole: ``body`` asks vLLM for one unstreamed answer (``to_openai``'s ``whole``: a non-streamed request
            to a vLLM that reports timings, ``to_openai.final_only``).
        keep_alive: the request's ``keep_alive`` in seconds (``model_use.model_in_use``).
        session_key: the conversation's key for a router in front of several engines
            (``api/fleet/affinity.py``), sent unless the client sent its own (before a router scoped to
            its caller and bounded in flight: ``api/fleet/client_affinity.py``); ``None`` with
            ``--request-sessions on``: a one-request key, released at the router when the
            answer ends, however it ends (``api/fleet/router_release.py``).
        truncate, shift: Ollama's: a request vLLM refuses for its context is made to fit (``context_fit.py``:
            its oldest turns dropped, its output lowered to the room left) and sent again, once; false: refused.

    Raises what ``model_in_use``, ``finish`` and ``relay`` raise before the first byte
    (the model cannot be loaded, the context is full, vLLM refused the request). A client that leaves
    mid-answer is charged the chunks it was sent (the translator's count: vLLM sends one a token) and
    its prompt by the body's size, unless vLLM's usage came first.
    """
    model, backend = use.model, use.backend
    assert backend is not None
    out = translator(use.name, timings, aggregate=not stream)
    settings = request.app[SETTINGS]
    with request.app[CLIENT_AFFINITY].hold_request(request) as own:  # counted until the answer ends
        sent, release = affinity.placement(settings.session_header, own, session_key, settings.request_sessions == "on")
        headers = {**affinity.JSON, **sent}
        async with model_in_use(request, backend, keep_alive):
            await finish(call, body, path, served=model.name, model=model, upstream=backend.upstream, made=use.made,
                         token_ids=settings.resume and not whole)
            resume = None
            if settings.resume and not whole:
                seconds, _ = resume_timeout(settings.resume_timeout, backend.board)
                resume = Resume(path, body, backend.upstream, backend.board, request.app[WORKER], seconds,
                                model.max_model_len, headers, request.path)
            fitted = False
            try:
                while True:
                    try:
                        return await relay(request, call, backend.upstream, path, body, out, stream=stream, headers=headers,
                                           final_only=whole, resume=resume)
                    except UpstreamRejected as e:  # over the context: made to fit once, as Ollama's truncate and shift do
                        if fitted or not is_context_full(e) or not model.max_model_len:
                            raise
                        fitted = True
                        before = len(body.get("messages") or ())
                        if await fit(backend.upstream, body, model.max_model_len, truncate=truncate, shift=shift) is None:
                            raise refusal(e) from None
                        log.info("context_fit", messages_before=before, messages_after=len(body.get("messages") or ()),
                                 max_tokens=body.get("max_tokens"), truncate_prompt_tokens=body.get("truncate_prompt_tokens"))
            except (ConnectionError, asyncio.CancelledError):  # the client left mid-answer: vLLM's tokens so far were made
                if call.usage is None and out.output_tokens:
                    call.usage = (out.prompt_eval_count or int(prompt_tokens_guess(call.body)), out.output_tokens)
                raise
            finally:
                if release is not None:  # after the answer's last byte, or its error, or the client's leaving
                    request.app[ROUTER_RELEASE].release(backend.upstream, release)
