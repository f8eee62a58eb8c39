"""vLLM's answer relayed to an Ollama client: the request goes upstream at once and the answer
streams straight through a translator (``ollama/to_ollama.py``).

:func:`relay` sends the body, feeds each decoded SSE chunk to the translator and writes what it
returns: NDJSON when the client streams, one JSON object when not. Upstream is streamed in both modes,
so TTFT is measured alike, except a non-streamed request to a vLLM with
``--enable-per-request-metrics``, whose durations come from vLLM's ``metrics``
(``to_ollama.unstreamed_timings``). Metrics are observed once per request. Source: ``docs/wire.md``
"Responses" (exactly one final chunk) and Ollama's ``server/routes.go`` ``streamResponse`` (an error
after the stream began is the last NDJSON line).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

import orjson
from aiohttp import web

from vllama_proxy.errors import UpstreamProtocolError, VllamaError, error_line
from vllama_proxy.upstream import SSEDecoder, Upstream, encode_json, iter_sse, read_json, read_some
from ..app_state import ACCEPTED
from .call import Call
from ..policy.fair_queue import prompt_tokens_guess
from ..metrics import TTFT, observe_stages, observe_tpot
from ..ollama.ndjson import begin
from ..ollama.to_ollama import Translator, response_chunk, unstreamed_timings
from .resume import Resume

_T = TypeVar("_T")


async def in_own_task(loop: Coroutine[Any, Any, _T]) -> _T:
    """``await loop`` (the loop reading a streamed body) in a task of its own; its result or error.

    Each time a suspended coroutine is resumed, every frame of the chain awaiting it is resumed
    with it: a read inside a handler went back through aiohttp's request task (``_handle_request``),
    ``Application._handle``, its ``_fix_request_current_app``, each of vllama's middlewares
    (``api/app.py``), the route and ``answer.py``: 10 to 12 frames resumed for every token a stream
    relays (``tests/test_token_path.py``). In its own task a read resumes the loop's frames
    only, for less CPU per token at a small cost per request (``docs/decisions.md``). The handler awaits the task, so the task's result, its errors and a
    cancellation pass as before: the client gone, aiohttp cancels the handler's task, which cancels
    the task it waits for. The task runs in a copy of the request's context (``request_id`` in the
    log lines); it costs one task per request.
    """
    return await asyncio.get_running_loop().create_task(loop)


async def _unstreamed(request: web.Request, call: Call, resp: Any, translator: Translator) -> web.Response:
    """The aggregated Ollama answer from vLLM's non-streamed one (``relay(final_only=True)``)."""
    t = translator.t
    data = await read_json(resp)
    end = t.first_read = time.perf_counter_ns()
    if not isinstance(data, dict):
        raise UpstreamProtocolError(f"vLLM's answer is not a JSON object: {str(data)[:200]}")
    translator.feed(response_chunk(data))
    if not translator.finished:
        raise UpstreamProtocolError("vLLM's answer has no finish reason: it may be incomplete")
    unstreamed_timings(t, data, end)
    observe_stages(request.get(ACCEPTED) or t.received, t, 0)
    final = translator.final()
    _charged(request, call, t, translator)
    return web.Response(body=orjson.dumps(final), content_type="application/json")


def _charged(request: web.Request, call: Call, t: Any, translator: Translator) -> None:
    """A finished answer's TPOT observed and its ``(prompt, output)`` tokens left for the settler."""
    call.usage = (translator.prompt_eval_count, translator.output_tokens)
    observe_tpot(request.path, t, translator.output_tokens)


async def relay(
    request: web.Request,
    call: Call,
    upstream: Upstream,
    path: str,
    body: dict[str, Any],
    translator: Translator,
    *,
    stream: bool,
    headers: Mapping[str, str] | None = None,
    final_only: bool = False,
    resume: Resume | None = None,
) -> web.StreamResponse:
    """Send ``body`` to vLLM at ``path`` and answer the client in Ollama's format; ``call`` (the request's record)
    gets the usage vLLM reported, or what was relayed before vLLM failed, and a stream's error, for the settler.

    Errors before the first byte to the client (vLLM's 4xx, unreachable upstream, and an
    error event vLLM streams before any token, such as a bad JSON schema) propagate as
    exceptions and become a status + ``{"error"}``: the NDJSON response begins with its
    first line, as Ollama's ``streamResponse`` sends its headers with the first chunk.
    Once the stream began, an error becomes its last line and the stream ends. A stream
    that ends without a finish reason is an error too, never a silent truncation.

    The streamed loop is the proxy's hot path (one pass per upstream read, usually one
    token): decode, translate, one write; metrics are observed once per request. It runs in a
    task of its own (:func:`in_own_task`), as does the loop gathering a non-streamed answer.
    ``headers`` replace the JSON content type sent upstream (``api/fleet/affinity.py`` adds the
    conversation's key for a router). ``final_only`` (with ``stream`` false): ``body`` asks
    vLLM for one unstreamed answer (``to_openai``'s ``whole``) and the durations come from its
    ``metrics`` (``to_ollama.unstreamed_timings``). ``resume``: a stream (or a non-streamed answer read as
    one) that vLLM breaks is asked again and continued (``resume.py``).
    """
    t = translator.t
    t.sent = time.perf_counter_ns()
    try:
        try:
            async with upstream.request("POST", path, body=encode_json(body), headers=headers) as resp:
                t.headers = time.perf_counter_ns()
                if final_only and not stream:
                    return await _unstreamed(request, call, resp, translator)  # one read: no loop to run in a task of its own
                # vLLM streams either way: an event per token, read in a task of the loop's own
                return await in_own_task((_streamed if stream else _aggregated)(request, call, upstream, resp, translator, resume))
        except VllamaError as e:
            # vLLM failed before its answer began (its engine dead: a 500, or the connection refused): asked again,
            # unless the vLLM still serves (a 500 of its own for this request: passed on at once)
            if t.headers or resume is None or not await resume.asked_again(e):
                raise
            resp = await resume.reopen(e)
            t.headers = time.perf_counter_ns()
            return await in_own_task((_streamed if stream else _aggregated)(request, call, upstream, resp, translator, resume))
    finally:
        if resume is not None and resume.times:
            await resume.close()


async def _aggregated(request: web.Request, call: Call, upstream: Upstream, resp: Any, translator: Translator,
                      resume: Resume | None = None) -> web.Response:
    """The aggregated Ollama answer from vLLM's stream (:func:`relay` without ``stream``)."""
    t = translator.t
    feed = translator.feed
    take = resume.take if resume is not None else None
    while True:
        try:
            with upstream.watch_body(resp):
                async for batch in iter_sse(resp):
                    if not t.first_read:
                        t.first_read = time.perf_counter_ns()
                    if take is not None:
                        batch = take(batch)
                    for chunk in batch:
                        feed(chunk)
            break
        except VllamaError as e:
            if resume is None or not _resumes(resume, e, translator):
                raise
            resp.close()
            resp = await resume.reopen(e, translator.in_reasoning)
    if not translator.finished:
        raise _unfinished()
    observe_stages(request.get(ACCEPTED) or t.received, t, 0)
    final = translator.final()
    if t.first:
        TTFT.labels(request.path).observe((t.first - t.received) / 1e9)
    _charged(request, call, t, translator)
    return web.Response(body=orjson.dumps(final), content_type="application/json")


async def _streamed(request: web.Request, call: Call, upstream: Upstream, resp: Any, translator: Translator,
                    resume: Resume | None = None) -> web.StreamResponse:
    """The streamed answer's loop (:func:`relay` with ``stream``): one pass per upstream read; with ``resume``, a
    break of vLLM's stream pauses the client's while the stream is asked again (``resume.py``)."""
    t = translator.t
    route = request.path
    feed = translator.feed
    out: web.StreamResponse | None = None
    dumps = orjson.dumps
    decoder = SSEDecoder()
    decode = decoder.feed
    first_write = 0
    take = resume.take if resume is not None else None
    watch = upstream.watch_body(resp)  # the idle-read timeout, without a timer per read
    try:
        while True:
            try:
                while not decoder.done:
                    # One write per upstream read: under load several events arrive per read.
                    data = await read_some(resp)
                    if not first_write and not t.first_read:
                        t.first_read = time.perf_counter_ns()
                    chunks = decode(data)
                    if take is not None:
                        chunks = take(chunks)
                    lines = [dumps(item) for chunk in chunks for item in feed(chunk)]
                    if lines:
                        if out is None:
                            out = await begin(request)
                        await out.write(b"\n".join(lines) + b"\n" if len(lines) > 1 else lines[0] + b"\n")
                        if not first_write:  # TTFT as the client sees it, even if the stream fails later
                            first_write = time.perf_counter_ns()
                            TTFT.labels(route).observe((first_write - t.received) / 1e9)
                            observe_stages(request.get(ACCEPTED) or t.received, t, first_write)
                    if decoder.failure is not None:
                        raise decoder.failure
                break
            except VllamaError as e:
                if resume is None or not _resumes(resume, e, translator):
                    raise
                watch.close()
                resp.close()
                resp = await resume.reopen(e, translator.in_reasoning)  # the client's stream pauses here
                decoder = SSEDecoder()
                decode = decoder.feed
                watch = upstream.watch_body(resp)
        if not translator.finished:
            raise _unfinished()
        last = dumps(translator.final()) + b"\n"
        _charged(request, call, t, translator)
    except VllamaError as e:
        if out is None:
            raise  # nothing sent yet: the client gets the status and the error
        call.stream_error = e
        if translator.output_tokens:  # what was relayed before vLLM failed was made, and read
            call.usage = (translator.prompt_eval_count or int(prompt_tokens_guess(call.body)), translator.output_tokens)
        last = error_line(e)
    finally:
        watch.close()
    if out is None:
        out = await begin(request)
    await out.write_eof(last)  # the last line and the end of the chunked body in one write
    return out


def _resumes(resume: Resume, error: VllamaError, translator: Translator) -> bool:
    """Whether the stream broken by ``error`` is continued (``Resume.can``); a chat's tool calls reach its client
    only whole (``ChatTranslator``), so one being written when vLLM broke is dropped here, to be written again
    from its start by the continuation."""
    if not resume.can(error, calls_sent=bool(getattr(translator, "tool_calls", None))):
        return False
    getattr(translator, "drop_partial_calls", lambda: None)()
    return True


def _unfinished() -> UpstreamProtocolError:
    return UpstreamProtocolError("vLLM ended the stream ([DONE]) without a finish reason: the answer may be incomplete")
